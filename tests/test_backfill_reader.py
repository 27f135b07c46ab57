"""backfill_reader on a real Postgres: a page's query budget covers that query and nothing else."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from sequin_provider.backfill_reader import copy_out, read_page


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
