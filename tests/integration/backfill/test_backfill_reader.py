"""backfill_reader on a real Postgres: a page's query budget covers that query and nothing else; a
page's COPY bytes lose their order key column exactly."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from sequin_provider.backfill.reader import copy_out, read_page, staged_page_end, without_order_key


def test_a_page_budget_cancels_the_page_query_and_only_it(dsn: str) -> None:
    """The watermarks around a page run on the same connection: the budget must not outlive the page
    (CI once failed a backfill when a high watermark's commit took longer than a 300 ms budget)."""
    slow = sql.SQL("COPY (SELECT pg_sleep(0.6), 1) TO STDOUT")
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = conn.execute("SHOW statement_timeout").fetchone()
        with pytest.raises(psycopg.errors.QueryCanceled):
            copy_out(conn, slow, budget_ms=100)
        # after a cancelled page and after a page that fit, the session is as it was
        assert read_page(conn, sql.SQL("COPY (SELECT E'a\\tb', NULL) TO STDOUT"), budget_ms=5000) == [["a\tb", None]]
        assert conn.execute("SHOW statement_timeout").fetchone() == before
        started = conn.execute("SELECT clock_timestamp()").fetchone()
        conn.execute("SELECT pg_sleep(0.3), pg_logical_emit_message(true, 'sequin:test', '')")  # a slow watermark
        assert conn.execute("SELECT clock_timestamp() - %s >= interval '0.3 s'", started).fetchone() == (True,)
        assert copy_out(conn, slow) == b"\t1\n"  # no budget: the statement runs to its end


def test_a_reads_page_loses_exactly_its_order_key_column(dsn: str) -> None:
    """Every line but the last has a null order key; values that look like one (a text ``\\N``, tabs,
    newlines, backslashes) stay as they are: the result is what Postgres writes for the page without
    that column."""
    values = ["plain", "\\N", "ends in \\", "tab\there", "line\nbreak", "\\N\t", "", None, "last"]
    rows = sql.SQL(", ").join(
        sql.SQL("({}, {}::int)").format(sql.Literal(v), sql.Literal(i)) for i, v in enumerate(values)
    )
    page = sql.SQL(
        "SELECT v, i, CASE WHEN i = {} THEN ARRAY[v, E'k\\t\\\\N'] END FROM (VALUES {}) AS t (v, i) ORDER BY i"
    ).format(sql.Literal(len(values) - 1), rows)
    with psycopg.connect(dsn, autocommit=True) as conn:
        data = copy_out(conn, sql.SQL("COPY ({}) TO STDOUT").format(page))
        expected = copy_out(conn, sql.SQL("COPY (SELECT v, i FROM ({}) AS p) TO STDOUT").format(page))
    assert staged_page_end(data) == (len(values), ["last", "k\t\\N"])
    assert bytes(without_order_key(data)) == bytes(expected)
    assert bytes(without_order_key(bytes(data))) == bytes(expected)
