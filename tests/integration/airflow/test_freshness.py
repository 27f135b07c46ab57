"""``sequin_provider.freshness`` on a real Postgres: a sink with a message parked before the mark is
behind, and a mark the slot never confirms makes no sink complete (never ahead of what is delivered,
end to end under ``dag.test`` with concurrent writes: tests/integration/airflow/test_dags.py)."""

from __future__ import annotations

import psycopg

from sequin_provider import store
from sequin_provider.freshness import measure_freshness, sinks_parked_below
from tests.support.postgres import execute


def test_a_sink_with_a_message_parked_before_the_mark_is_behind(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        store.park_messages(
            conn,
            "sequin",
            [
                store.ParkRow("hooks", 100, 0, "g1", "k1", "{}", None, 1, "HTTP 500"),
                store.ParkRow("late", 500, 0, "g1", "k2", "{}", None, 1, "HTTP 500"),
            ],
        )
        conn.commit()
        assert sinks_parked_below(conn, "sequin", ["hooks", "late", "clean"], 300) == {"hooks"}
        assert sinks_parked_below(conn, "sequin", ["hooks", "late", "clean"], 100) == set()
        conn.execute("UPDATE sequin.buffered_messages SET state = 'discarded' WHERE sink = 'hooks'")
        conn.commit()
        assert sinks_parked_below(conn, "sequin", ["hooks"], 300) == set()  # discarded: not waited for


def test_no_sink_is_complete_through_a_mark_the_slot_does_not_confirm(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    execute(dsn, "SELECT pg_create_logical_replication_slot('fresh_idle', 'pgoutput')", "CREATE TABLE w (id int)")
    try:
        execute(dsn, "INSERT INTO w VALUES (1)")  # WAL after the slot: nobody reads it
        measured = measure_freshness(dsn, dsn, "sequin", "fresh_idle", ["a", "b"], timeout=1.0)
        assert measured.confirmed_lsn is None and measured.complete == () and measured.behind == ("a", "b")
        missing = measure_freshness(dsn, dsn, "sequin", "no_such_slot", ["a"], timeout=0.5)
        assert missing.confirmed_lsn is None and missing.complete == ()
    finally:
        execute(dsn, "SELECT pg_drop_replication_slot('fresh_idle')")
