"""backfill_reader on a real Postgres: a page's query budget covers that query and nothing else; a
page's COPY bytes lose their order key column exactly."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from sequin_provider.backfill.reader import (
    PageQuery,
    copy_out,
    read_page,
    staged_page_end,
    table_shape,
    without_order_key,
)


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


def test_pages_with_a_condition_walk_the_keyset_and_hold_exactly_the_matching_rows(dsn: str) -> None:
    """The condition is AND-ed in parentheses with the keyset predicate: small pages over two key
    ranges (and a partial backfill's start) read exactly the matching rows, each once, in key order;
    an ``OR`` in it does not widen a page past its cursor or its range."""
    where = "status = 'paid' AND region = 'eu' OR id = 3"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS paid_orders")
        conn.execute("CREATE TABLE paid_orders (id int PRIMARY KEY, status text, region text, at int)")
        conn.execute(
            "INSERT INTO paid_orders SELECT g, CASE WHEN g % 3 = 0 THEN 'paid' ELSE 'open' END,"
            " CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g % 50 FROM generate_series(1, 997) g"
        )
        shape = table_shape(conn, "public", "paid_orders")

        def walk(query: PageQuery) -> list[int]:
            ids: list[int] = []
            cursor = None
            for _ in range(200):  # a condition that escaped its parentheses would page forever
                rows = read_page(conn, query.sql(cursor, 7))
                if not rows:
                    return ids
                ids += [int(r[0]) for r in rows]  # type: ignore[arg-type]
                cursor = [str(rows[-1][shape.columns.index(c)]) for c in query.order]
            raise AssertionError(f"pages did not end: {ids[:20]}")

        full = [
            i
            for lower, upper in ((None, ["500"]), (["500"], None))
            for i in walk(PageQuery(shape, ("id",), lower, upper, where=where))
        ]
        assert full == [3] + [g for g in range(1, 998) if g % 6 == 0]
        partial = walk(PageQuery(shape, ("at", "id"), None, None, "at", "40", where=where))
        assert sorted(partial) == [g for g in range(1, 998) if g % 6 == 0 and g % 50 >= 40]
        assert len(partial) == len(set(partial))
