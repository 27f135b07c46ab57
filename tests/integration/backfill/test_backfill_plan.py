"""Backfill requests are checked against the config and the source catalog before anything is recorded."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from sequin_provider import backfill, store
from sequin_provider.config import load_config
from sequin_provider.store import BackfillError
from tests.support.config import write_config
from tests.support.postgres import execute


@pytest.fixture
def setup(tmp_path: Path, dsn: str) -> tuple[psycopg.Connection, object]:
    execute(
        dsn,
        "CREATE TABLE orders (id int PRIMARY KEY, updated_at timestamptz, n int)",
        "INSERT INTO orders SELECT g, '2024-01-01'::timestamptz + g * interval '1 hour', g FROM generate_series(1, 500) g",
        "ANALYZE orders",
        "CREATE TABLE nopk (id int)",
        "CREATE TABLE other (id int PRIMARY KEY)",
    )
    config = load_config(
        write_config(
            tmp_path / "sequin.yaml",
            f"""
        databases: [{{name: app, dsn: "{dsn}"}}]
        sinks:
          - {{name: orders, tables: [orders, nopk, ghost], destination: {{type: sequin_stream}}}}
        """,
        )
    )
    conn = psycopg.connect(dsn)
    store.migrate(conn)
    yield conn, config
    conn.close()


def test_full_and_partial_requests_are_recorded(setup: tuple) -> None:
    conn, config = setup
    full = backfill.create_backfill(conn, conn, config, "orders", "orders")
    assert (full.kind, full.table_schema, full.table_name, full.state, full.rows_initial) == (
        "full",
        "public",
        "orders",
        "pending",
        500,
    )
    store.transition_backfill(conn, "sequin", full.id, "cancelled")
    plan = backfill.plan_backfill(conn, config, "orders", "public.orders", "updated_at", "2024-01-11 00:00:00+00", 250)
    assert (plan.kind, plan.sort_type, plan.primary_key, plan.max_query_ms) == (
        "partial",
        "timestamp with time zone",
        ("id",),
        250,
    )
    assert 200 <= (plan.estimated_rows or 0) <= 400  # the planner's estimate of rows from hour 240 on


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nosink", "orders"), "unknown sink 'nosink' (configured sinks: orders)"),
        (
            ("orders", "other"),
            "sink 'orders' does not capture public.other (its tables: public.orders, public.nopk, public.ghost)",
        ),
        (("orders", "ghost"), "table public.ghost does not exist in database 'app'"),
        (("orders", "nopk"), "table public.nopk has no primary key"),
        (
            ("orders", "orders", "nope", "1"),
            "sort column 'nope' is not a column of public.orders (columns: id, updated_at, n)",
        ),
        (
            ("orders", "orders", "updated_at", "yesterday-ish"),
            "start position 'yesterday-ish' is not a valid timestamp with time zone",
        ),
        (("orders", "orders", "n", "1.5"), "start position '1.5' is not a valid integer"),
        (("orders", "orders", "updated_at", None), "needs a start position"),
        (("orders", "orders", None, "2024-01-01"), "a start position needs a sort column"),
        (("orders", "orders", None, None, 0), "max_query_ms must be an integer between 1 and 600000"),
        (("orders", "orders", None, None, 600_001), "max_query_ms must be an integer between 1 and 600000"),
        (
            ("orders", "orders", None, None, 5000, None, "nope = 1"),
            "backfill condition 'nope = 1' is not valid on the source: column \"nope\" does not exist",
        ),
        (
            ("orders", "orders", None, None, 5000, None, "n = = 1"),
            "backfill condition 'n = = 1' is not valid on the source: syntax error at or near \"=\"",
        ),
        (("orders", "orders", None, None, 5000, None, "n + 1"), "argument of WHERE must be type boolean"),
        (("orders", "orders", None, None, 5000, None, "n > 1; DELETE FROM orders"), "';' is not allowed"),
        (("orders", "orders", None, None, 5000, None, "n > 1) OR (true"), "unbalanced parentheses"),
        (("orders", "orders", None, None, 5000, None, "n > 1 --"), "comments are not allowed"),
        (("orders", "orders", None, None, 5000, None, "n = 'x"), "unterminated string"),
    ],
)
def test_bad_requests_are_clear_and_record_nothing(setup: tuple, args: tuple, message: str) -> None:
    conn, config = setup
    with pytest.raises(BackfillError) as err:
        backfill.create_backfill(conn, conn, config, *args)
    assert message in str(err.value)
    assert store.list_backfills(conn, "sequin") == []


def test_second_active_backfill_for_the_same_sink_and_table(setup: tuple) -> None:
    conn, config = setup
    first = backfill.create_backfill(conn, conn, config, "orders", "orders")
    with pytest.raises(BackfillError, match=f"backfill {first.id} \\(pending\\)"):
        backfill.create_backfill(conn, conn, config, "orders", "orders", "updated_at", "2024-01-01")
    assert len(store.list_backfills(conn, "sequin")) == 1


def test_a_condition_is_checked_read_only_recorded_and_narrows_the_estimate(setup: tuple) -> None:
    conn, config = setup
    where = "  n % 2 = 0 AND (updated_at < '2024-01-11' OR n = 499) AND ';' <> '('  "
    created = backfill.create_backfill(conn, conn, config, "orders", "orders", where=where)
    assert created.where == where.strip() and created.kind == "full"
    assert created.rows_initial is not None and created.rows_initial < 500  # the planner's estimate with it
    assert store.get_backfill(conn, "sequin", created.id).where == where.strip()
    store.transition_backfill(conn, "sequin", created.id, "cancelled")
    # empty: every row, as without one
    assert backfill.plan_backfill(conn, config, "orders", "orders", where="  ").where is None
    # a partial backfill takes one too
    plan = backfill.plan_backfill(
        conn, config, "orders", "orders", "updated_at", "2024-01-11 00:00:00+00", where="n % 2 = 0"
    )
    assert (plan.kind, plan.where) == ("partial", "n % 2 = 0")
    # the check's read-only transaction and timeout are rolled back: the session is as it was
    assert conn.execute("SHOW transaction_read_only").fetchone() == ("off",)
    assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
    conn.execute("INSERT INTO other VALUES (1)")
    conn.commit()
