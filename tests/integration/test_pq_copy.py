"""pq_copy on a real Postgres: ``copy_out_text`` returns byte for byte what psycopg's own COPY reads,
raises the server's errors as psycopg does, and leaves the connection as psycopg's COPY leaves it."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg import pq, sql

from sequin_provider.pq_copy import copy_out_text, libpq_copy_functions, psycopg_copy_out

BOTH = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "reference"])
"""The compiled ``copy_out_into`` and its reference loop, each held to psycopg's own COPY."""


def psycopg_copy(conn: psycopg.Connection[Any], query: sql.Composable) -> bytes:
    """The reference: psycopg's ``Copy``, one row per ``read()``."""
    return bytes(psycopg_copy_out(conn, query))


AWKWARD = sql.SQL(
    "SELECT g, CASE g % 7 WHEN 0 THEN NULL WHEN 1 THEN E'tab\\there' WHEN 2 THEN E'line\\nbreak'"
    " WHEN 3 THEN E'back\\\\slash' WHEN 4 THEN '' WHEN 5 THEN 'ünïcødé ✓' ELSE repeat('x', g % 3000) END,"
    " jsonb_build_object('n', g, 'tag', md5(g::text)), g::numeric / 7 FROM generate_series(1, {}) g"
)


@BOTH
@pytest.mark.parametrize("rows", [0, 1, 250_000])
def test_the_output_is_psycopgs_byte_for_byte(dsn: str, rows: int, compiled: bool) -> None:
    """Every row, in order, escapes and NULLs as the server wrote them; 250,000 rows (about 200 MB)
    arrive over many reads of the socket, so the loop waits for libpq again and again."""
    assert not compiled or libpq_copy_functions() is not None, "psycopg's binary libpq is installed here"
    query = sql.SQL("COPY ({}) TO STDOUT").format(AWKWARD.format(sql.Literal(rows)))
    with psycopg.connect(dsn, autocommit=True) as conn:
        expected = psycopg_copy(conn, query)
        got = copy_out_text(conn, query, compiled)
        assert isinstance(got, bytearray)
        assert bytes(got) == expected
        assert got.count(b"\n") == rows
        binary = sql.SQL("COPY ({}) TO STDOUT (FORMAT binary)").format(AWKWARD.format(sql.Literal(min(rows, 1000))))
        assert bytes(copy_out_text(conn, binary, compiled)) == psycopg_copy(conn, binary)
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert conn.execute("SELECT 1").fetchone() == (1,)


@BOTH
def test_a_server_error_during_the_copy_is_raised_and_the_connection_stays_usable(dsn: str, compiled: bool) -> None:
    """An error after rows were sent (a division by zero at row 40,000; a statement timeout) is
    raised as psycopg's class for its SQLSTATE, and the session is idle and usable afterwards."""
    failing = sql.SQL("COPY (SELECT g, 1 / (40000 - g) FROM generate_series(1, 50000) g) TO STDOUT")
    slow = sql.SQL("COPY (SELECT pg_sleep(0.5), 1) TO STDOUT")
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero, match="division by zero"):
            copy_out_text(conn, failing, compiled)
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        conn.execute("SET statement_timeout = 100")
        with pytest.raises(psycopg.errors.QueryCanceled):
            copy_out_text(conn, slow, compiled)
        conn.execute("RESET statement_timeout")
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert bytes(copy_out_text(conn, sql.SQL("COPY (SELECT 'after') TO STDOUT"))) == b"after\n"
        with pytest.raises(psycopg.ProgrammingError, match="not a COPY"):
            copy_out_text(conn, sql.SQL("SELECT 1"))
        assert conn.execute("SELECT 2").fetchone() == (2,)


def test_in_a_transaction_it_reads_what_the_transaction_sees_and_leaves_it_open(dsn: str) -> None:
    """Not autocommit: an idle connection gets psycopg's transaction (its COPY opens it), and a
    COPY inside a transaction sees that transaction's own uncommitted rows; nothing is committed."""
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE t (v text)")
        conn.commit()
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert bytes(copy_out_text(conn, sql.SQL("COPY t TO STDOUT"))) == b""
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        conn.execute("INSERT INTO t VALUES ('mine')")
        assert bytes(copy_out_text(conn, sql.SQL("COPY t TO STDOUT"))) == b"mine\n"
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        conn.rollback()
        assert bytes(copy_out_text(conn, sql.SQL("COPY t TO STDOUT"))) == b""


@BOTH
def test_a_connection_lost_during_the_copy_raises_an_operational_error(dsn: str, compiled: bool) -> None:
    """The backend is terminated while it sends rows: an ``OperationalError``, no hang, no partial
    output returned."""
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as killer:
        pid = conn.info.backend_pid
        query = sql.SQL(
            "COPY (SELECT g, CASE WHEN g = 20000 THEN pg_sleep(5)::text END FROM generate_series(1, 40000) g) TO STDOUT"
        )
        timer = threading.Timer(1.0, lambda: killer.execute("SELECT pg_terminate_backend(%s)", (pid,)))
        timer.start()
        try:
            with pytest.raises(psycopg.OperationalError):
                copy_out_text(conn, query, compiled)
        finally:
            timer.join()
        assert conn.closed or conn.info.status == pq.ConnStatus.BAD
