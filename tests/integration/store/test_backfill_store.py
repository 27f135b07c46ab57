"""Backfill records in the store: defaults, one active per sink and table, checked transitions, progress."""

from __future__ import annotations

import psycopg
import pytest

from sequin_provider import store
from sequin_provider.store import BackfillError


@pytest.fixture
def conn(dsn: str) -> psycopg.Connection:
    connection = psycopg.connect(dsn)
    store.migrate(connection)
    yield connection
    connection.close()


def test_create_with_defaults(conn: psycopg.Connection) -> None:
    b = store.create_backfill(conn, "sequin", "orders", "public", "orders", rows_initial=42)
    assert (b.kind, b.state, b.max_query_ms, b.rows_initial, b.rows_processed, b.cursor) == (
        "full",
        "pending",
        5000,
        42,
        0,
        None,
    )
    p = store.create_backfill(conn, "sequin", "orders", "public", "items", "partial", "updated_at", "2024-01-01", 250)
    assert (p.kind, p.sort_column, p.start_position, p.max_query_ms) == ("partial", "updated_at", "2024-01-01", 250)
    assert [x.id for x in store.list_backfills(conn, "sequin", "orders")] == [p.id, b.id]


def test_at_most_one_active_per_sink_and_table(conn: psycopg.Connection) -> None:
    first = store.create_backfill(conn, "sequin", "orders", "public", "orders")
    with pytest.raises(
        BackfillError, match=rf"already has an active backfill of public.orders: backfill {first.id} \(pending\)"
    ):
        store.create_backfill(conn, "sequin", "orders", "public", "orders")
    store.create_backfill(conn, "sequin", "other_sink", "public", "orders")  # another sink: fine
    store.transition_backfill(conn, "sequin", first.id, "running")
    with pytest.raises(BackfillError, match=r"\(running\)"):
        store.create_backfill(conn, "sequin", "orders", "public", "orders")
    store.transition_backfill(conn, "sequin", first.id, "completed")
    assert store.create_backfill(conn, "sequin", "orders", "public", "orders").state == "pending"


def test_transitions_are_checked(conn: psycopg.Connection) -> None:
    b = store.create_backfill(conn, "sequin", "s", "public", "t")
    with pytest.raises(BackfillError, match="is pending: it cannot become completed"):
        store.transition_backfill(conn, "sequin", b.id, "completed")
    running = store.transition_backfill(conn, "sequin", b.id, "running")
    assert running.state == "running" and running.started_at is not None
    failed = store.transition_backfill(conn, "sequin", b.id, "failed", error="statement timeout")
    assert (failed.state, failed.error) == ("failed", "statement timeout") and failed.finished_at is not None
    for target in ("running", "completed", "cancelled", "failed"):
        with pytest.raises(BackfillError, match="is failed"):
            store.transition_backfill(conn, "sequin", b.id, target)
    with pytest.raises(BackfillError, match="unknown target state"):
        store.transition_backfill(conn, "sequin", b.id, "paused")
    c = store.create_backfill(conn, "sequin", "s", "public", "t")
    assert store.transition_backfill(conn, "sequin", c.id, "cancelled").state == "cancelled"
    with pytest.raises(BackfillError, match="no backfill with id 999999"):
        store.transition_backfill(conn, "sequin", 999_999, "running")


def test_progress_only_while_running(conn: psycopg.Connection) -> None:
    b = store.create_backfill(conn, "sequin", "s", "public", "t")
    with pytest.raises(BackfillError, match="not running"):
        store.record_backfill_progress(conn, "sequin", b.id, {"id": [5]}, 5, 5)
    store.transition_backfill(conn, "sequin", b.id, "running")
    store.record_backfill_progress(conn, "sequin", b.id, {"id": [5]}, 5, 4)
    store.record_backfill_progress(conn, "sequin", b.id, {"id": [9]}, 4, 4)
    got = store.get_backfill(conn, "sequin", b.id)
    assert (got.cursor, got.rows_processed, got.rows_emitted) == ({"id": [9]}, 9, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_query_ms": 0}, "between 1 and 600000"),
        ({"max_query_ms": 600_001}, "between 1 and 600000"),
        ({"max_query_ms": "5000"}, "between 1 and 600000"),
        ({"max_query_ms": True}, "between 1 and 600000"),
        ({"kind": "partial"}, "needs a sort column"),
        ({"sort_column": "x"}, "needs a sort column"),
        ({"kind": "delta"}, "'full' or 'partial'"),
    ],
)
def test_bad_requests(conn: psycopg.Connection, kwargs: dict, message: str) -> None:
    with pytest.raises(BackfillError, match=message):
        store.create_backfill(conn, "sequin", "s", "public", "t", **kwargs)
    assert store.list_backfills(conn, "sequin") == []


def test_the_table_itself_enforces_the_budget_range(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "INSERT INTO sequin.backfills (sink, table_schema, table_name, kind, max_query_ms)"
            " VALUES ('s', 'public', 't', 'full', 0)"
        )
    conn.rollback()


def test_creating_and_moving_a_backfill_commit_durably_whatever_the_session_says(dsn: str) -> None:
    """A backfill the caller was told exists must survive a crash of the store: its commits are
    synchronous even in a session (or on a server) with ``synchronous_commit = off``. A trigger
    records the setting each write of the backfills table ran under."""
    lossy = psycopg.conninfo.make_conninfo(dsn, options="-c synchronous_commit=off")
    with psycopg.connect(lossy) as conn:
        store.migrate(conn)
        conn.execute("""
            CREATE TABLE IF NOT EXISTS sequin.seen_commit_modes (id bigint, state text, mode text);
            CREATE OR REPLACE FUNCTION sequin.seen_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO sequin.seen_commit_modes VALUES (NEW.id, NEW.state, current_setting('synchronous_commit'));
                RETURN NEW;
            END $$;
            CREATE OR REPLACE TRIGGER seen_commit_mode AFTER INSERT OR UPDATE ON sequin.backfills
                FOR EACH ROW EXECUTE FUNCTION sequin.seen_commit_mode();""")
        conn.commit()
        try:
            b = store.create_backfill(conn, "sequin", "durable", "public", "orders")
            store.transition_backfill(conn, "sequin", b.id, "running")
            store.transition_backfill(conn, "sequin", b.id, "cancelled")
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)  # the session's own is untouched
            assert conn.execute(
                "SELECT state, mode FROM sequin.seen_commit_modes WHERE id = %s ORDER BY state", (b.id,)
            ).fetchall() == [("cancelled", "on"), ("pending", "on"), ("running", "on")]
        finally:
            conn.rollback()
            conn.execute("DROP TRIGGER seen_commit_mode ON sequin.backfills")
            conn.execute("DROP TABLE sequin.seen_commit_modes")
            conn.commit()
