"""``COPY … TO STDOUT`` read into one buffer at libpq's level (psycopg's ``pq``), for backfill pages.

The server sends a COPY's output one message per row, and psycopg's ``Copy.read()`` returns one
message per call through its wait loop: 1-2 µs of the reading process's CPU per row, more than the
compiled decoder takes to render that row (a backfill page is 50,000 rows; ``bench/page_read.py``,
docs/performance.md, "Backfills"). ``copy_out_text`` takes every row libpq already holds in one
call of the compiled hot path (``_pgoutput_c.copy_out_into``: 0.2-0.5 µs per row; its reference, a
plain loop of ``get_copy_data``, 0.4-0.9) and waits on the socket only when libpq holds none; the
same bytes either way. It speaks the protocol as ``replication_protocol`` does for the slot: send
the query, take results until libpq has no more, so the connection is left idle (or in its
transaction) exactly as psycopg leaves it after its own COPY. A connection psycopg would first
open a transaction on (not autocommit, idle) is read through psycopg's ``Copy`` instead, which
opens it. ``libpq_copy_functions`` finds libpq's functions for both compiled loops, this one and
the slot reader's (``replication_protocol``).
"""

from __future__ import annotations

import ctypes
import functools
import select
import sys
from pathlib import Path
from typing import Any, Callable

import psycopg
from psycopg import pq, sql

from sequin_provider.pgoutput import COMPILED, hot_path


@functools.cache
def libpq_copy_functions() -> tuple[int, int] | None:
    """The addresses of ``PQgetCopyData`` and ``PQfreemem`` in the libpq psycopg's connections use, for
    the compiled reading loop; None when that library cannot be told for sure (then the reader reads
    one message at a time through psycopg, as its reference does).

    psycopg's binary wheel carries its own libpq (``psycopg_binary.libs``), which is the one loaded
    into this process from there; another libpq may be loaded beside it (psycopg2's wheel carries one
    too), so the library is found by its folder, never by name alone, and must report the version
    psycopg reports (``PQlibVersion``: the same build, so the same ``PGconn``)."""
    if pq.__impl__ != "binary" or "psycopg_binary" not in sys.modules:
        return None
    wheel_libs = Path(sys.modules["psycopg_binary"].__file__ or "").resolve().parent.parent / "psycopg_binary.libs"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            loaded = {line.split(maxsplit=5)[-1].strip() for line in maps if "/libpq" in line}
    except OSError:
        return None
    found = sorted(p for p in loaded if Path(p).parent == wheel_libs and Path(p).name.startswith("libpq"))
    if len(found) != 1:
        return None
    try:
        libpq = ctypes.CDLL(found[0])  # already loaded: the same handle, nothing loaded again
    except OSError:
        return None
    libpq.PQlibVersion.restype = ctypes.c_int
    if libpq.PQlibVersion() != pq.version():
        return None
    get_copy_data = ctypes.cast(libpq.PQgetCopyData, ctypes.c_void_p).value
    free_memory = ctypes.cast(libpq.PQfreemem, ctypes.c_void_p).value
    return (get_copy_data, free_memory) if get_copy_data and free_memory else None


def copy_out_text(conn: psycopg.Connection[Any], query: sql.Composable, compiled: bool = COMPILED) -> bytearray:
    """Run ``query`` (a ``COPY … TO STDOUT``) on ``conn`` and return its whole output, the rows'
    lines laid end to end as the server sent them. The server's error (a ``statement_timeout``'s
    ``QueryCanceled``, say) is raised as psycopg raises it, after the connection is idle again.
    ``compiled``: the buffered rows are taken by the compiled hot path where it and libpq's
    functions can be had (``libpq_copy_functions``), else by the reference loop."""
    if not conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
        return psycopg_copy_out(conn, query)
    functions = libpq_copy_functions() if compiled else None
    with conn.lock:
        return _copy_through_libpq(conn.pgconn, query.as_bytes(conn), conn.info.encoding, functions)


def psycopg_copy_out(conn: psycopg.Connection[Any], query: sql.Composable) -> bytearray:
    """psycopg's own COPY, one row per ``read()``: the reference ``copy_out_text`` is held to (and
    what it runs on a connection psycopg would first open a transaction on)."""
    out = bytearray()
    with conn.cursor() as cur, cur.copy(query) as copy:
        while data := copy.read():
            out += data
    return out


def _copy_through_libpq(
    pgconn: pq.abc.PGconn, query: bytes, encoding: str, functions: tuple[int, int] | None
) -> bytearray:
    """Send ``query`` and take its results until libpq has no more: the COPY's rows appended as
    libpq hands them over (with ``functions``, libpq's ``PQgetCopyData`` and ``PQfreemem``, by the
    compiled ``copy_out_into``), the first error result raised once the command is over."""
    pgconn.send_query(query)
    poll = select.poll()
    poll.register(pgconn.socket, select.POLLIN)
    while pgconn.flush():  # a nonblocking connection (psycopg's) may not have sent it all yet
        _wait(pgconn, select.POLLOUT)
    out = bytearray()
    error: psycopg.Error | None = None
    copied = False
    while True:
        while pgconn.is_busy():
            poll.poll()
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            break
        if result.status == pq.ExecStatus.COPY_OUT:
            copied = True
            take = _take_rows if functions is None else _compiled_take(functions)
            while (size := take(pgconn, out)) == 0:  # none buffered: wait for the socket
                poll.poll()
                pgconn.consume_input()
            if size != -1:  # -1: the rows' end, and the command's result follows
                raise psycopg.OperationalError(pgconn.get_error_message(encoding))
        elif result.status == pq.ExecStatus.FATAL_ERROR and error is None:
            error = psycopg.errors.error_from_result(result, encoding=encoding)
    if error is not None:
        raise error
    if not copied:
        raise psycopg.ProgrammingError(f"not a COPY … TO STDOUT: {query[:80].decode(encoding, 'replace')!r}")
    return out


def _take_rows(pgconn: pq.abc.PGconn, out: bytearray) -> int:
    """The reference of ``_pgoutput_c.copy_out_into``: the rows libpq holds appended to ``out``;
    returns the ``get_copy_data`` size that stopped it (0 none buffered, -1 the end, -2 an error)."""
    get_copy_data = pgconn.get_copy_data
    while True:
        size, data = get_copy_data(1)
        if size <= 0:
            return size
        out += data


def _compiled_take(functions: tuple[int, int]) -> Callable[[pq.abc.PGconn, bytearray], int]:
    """``_take_rows`` by the compiled hot path, through libpq's own functions."""
    get_copy_data, free_memory = functions
    copy_out_into = hot_path.copy_out_into
    # the pointer is asked for each time: None (a TypeError, never a freed pointer) once closed
    return lambda pgconn, out: copy_out_into(pgconn.pgconn_ptr, get_copy_data, free_memory, out)


def _wait(pgconn: pq.abc.PGconn, events: int) -> None:
    """Block until ``pgconn``'s socket is ready for ``events``."""
    poll = select.poll()
    poll.register(pgconn.socket, events)
    poll.poll()
