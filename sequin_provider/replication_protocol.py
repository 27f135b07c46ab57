"""The streaming replication protocol of a logical slot, spoken by us over libpq (psycopg's ``pq``).

Why not psycopg2's ``LogicalReplicationConnection``: it answers the walsender's keepalives on its
own, and when our last explicit flush position is at or past the start of the last data message
it read, it moves the flush position it reports to the keepalive's ``wal_end`` (psycopg2's
``pqpath.c``, keepalive branch). With interleaved transactions the messages of a transaction
replayed at its commit can all start below the commit we just confirmed; a keepalive that arrives
while we read them (the walsender asks for one after ``wal_sender_timeout/2`` without a reply: a GC
pause, a frozen VM, a busy reader) then confirms past transactions we received but have not
delivered, and a crash loses them (tests/integration/replication/test_replication_keepalive.py shows it).

Here the server hears exactly one position: the one the caller last passed to ``send_status``
(and nothing, ``0/0``, which the server ignores, before the first). A keepalive that asks for a
reply gets that same position. That is the invariant DESIGN §2.8 asks for, kept by construction.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any, NoReturn

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from sequin_provider.pq_copy import libpq_copy_functions

PG_EPOCH_OFFSET_US = 946_684_800_000_000
"""Microseconds from the Unix epoch to PostgreSQL's (2000-01-01), for status message clocks."""
_DATA_START = struct.Struct(">Q").unpack_from  # after b"w": dataStart (then walEnd, sendTime, the payload at 25)
_KEEPALIVE = struct.Struct(">QQB")  # after b"k": walEnd, sendTime, replyRequested
_STATUS = struct.Struct(">cQQQQB")  # b"r", write, flush, apply, clock, replyRequested
_W, _K = ord("w"), ord("k")


class ReplicationProtocolError(psycopg.OperationalError):
    """The replication connection failed; the text is the server's or libpq's own message."""


RowTaker = Callable[[int, int, int, list[Any], int, int], tuple[int, int, int, bytes | None]]
"""The compiled reading loop bound to a decoder (``PgOutputDecoder.take_rows``): called with libpq's
``PGconn *``, the addresses of ``PQgetCopyData`` and ``PQfreemem``, the list to append change rows
to and its limits; returns (rows appended, their bytes, code, message) (``_pgoutput_c.read_rows``)."""


def quote_option(value: str) -> str:
    """A START_REPLICATION option value as a SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


class ReplicationStream:
    """One logical replication connection in COPY BOTH mode: data messages out, status in.

    ``read()`` returns the next ``(data_start, payload)`` or None when nothing is buffered;
    keepalives are consumed inside it and answered, when they ask, with the position of the last
    ``send_status``. Not thread-safe: one thread owns it (``replication.ChangeReader``'s reader).
    """

    def __init__(self, dsn: str, session_options: str, status_interval: float = 10.0) -> None:
        conninfo = make_conninfo(dsn, replication="database", options=session_options)
        self._conn = pq.PGconn.connect(conninfo.encode())
        if self._conn.status != pq.ConnStatus.OK:
            message = self._error()
            self._conn.finish()
            raise ReplicationProtocolError(message)
        self._flush_lsn = 0
        self._status_interval = status_interval
        self._last_status = time.monotonic()
        self.wal_end = 0
        """The walsender's position as of the last keepalive read (for diagnostics)."""

    def _error(self, result: Any = None) -> str:
        text = result.error_message if result is not None and result.error_message else self._conn.error_message
        return text.decode("utf-8", "replace").strip() or "replication connection failed"

    def start(self, slot: str, start_lsn: str, options: dict[str, str]) -> None:
        """``START_REPLICATION SLOT slot LOGICAL start_lsn (options)``: the connection enters COPY BOTH."""
        rendered = ", ".join(f'"{k}" {quote_option(v)}' for k, v in options.items())
        command = f'START_REPLICATION SLOT "{slot}" LOGICAL {start_lsn}' + (f" ({rendered})" if rendered else "")
        result = self._conn.exec_(command.encode())
        if result.status != pq.ExecStatus.COPY_BOTH:
            raise ReplicationProtocolError(self._error(result))
        self._conn.nonblocking = 1
        self._last_status = time.monotonic()

    def fileno(self) -> int:
        """The socket, for ``select``."""
        return self._conn.socket

    def read(self) -> tuple[int, bytes] | None:
        """The next data message as ``(data_start, payload)``, or None when none is buffered."""
        conn = self._conn
        consumed = False
        while True:
            size, data = conn.get_copy_data(1)
            if size > 0:
                if data[0] == _W:  # the hot path: one per change
                    return _DATA_START(data, 1)[0], data[25:].tobytes()
                self._control(data)
                continue
            if size == 0:
                if consumed:
                    return None
                self._consume_input()
                consumed = True
                continue
            self._ended()

    def read_rows(
        self, take: RowTaker, pending: list[Any], max_rows: int, max_bytes: int
    ) -> tuple[int, tuple[int, bytes] | None]:
        """``read()`` and ``take``'s decoder's ``change_row`` in a compiled loop: appends to ``pending``
        the change row of each data message ``change_row`` takes, until ``max_rows`` rows or
        ``max_bytes`` bytes of payload were appended, nothing is buffered, or a message comes that
        it does not take. Returns (the bytes appended, that message as ``read()`` returns it, or
        None). ``libpq_copy_functions()`` must not be None."""
        functions = libpq_copy_functions()
        assert functions is not None, "read_rows() without the compiled loop's libpq functions"
        get_copy_data, free_memory = functions
        conn = self._conn
        consumed = False
        appended = 0
        while True:
            # the pointer is asked for each time: None (a TypeError, never a freed pointer) once closed
            rows, nbytes, code, message = take(
                conn.pgconn_ptr, get_copy_data, free_memory, pending, max_rows, max_bytes - appended
            )
            max_rows -= rows
            appended += nbytes
            if rows:
                consumed = False  # as read(), which consumes input again once the buffer ran dry
            if code == 2:
                assert message is not None
                if message[0] == _W:
                    return appended, (_DATA_START(message, 1)[0], message[25:])
                self._control(memoryview(message))
                continue
            if code == 0:
                return appended, None
            if code == 1:
                if consumed:
                    return appended, None
                self._consume_input()
                consumed = True
                continue
            self._ended()

    def _control(self, data: memoryview) -> None:
        """A message other than XLogData: a keepalive, answered when it asks."""
        kind = data[0]
        if kind == _K:
            self.wal_end, _, reply = _KEEPALIVE.unpack_from(data, 1)
            if reply:
                self.send_status()
            return
        raise ReplicationProtocolError(f"unexpected replication message type {chr(kind)!r}")

    def _consume_input(self) -> None:
        try:
            self._conn.consume_input()
        except psycopg.OperationalError as exc:
            raise ReplicationProtocolError(str(exc).strip() or self._error()) from None

    def _ended(self) -> NoReturn:
        """-1 from the copy: the server ended it (an error or a shutdown); -2: libpq's own error."""
        result = self._conn.get_result()
        raise ReplicationProtocolError(self._error(result))

    def send_status_if_due(self, interval: float | None = None) -> None:
        """Send a status update (the same position) when none went out for ``interval`` seconds
        (default: the stream's status interval), so the walsender never times us out."""
        if time.monotonic() - self._last_status >= (self._status_interval if interval is None else interval):
            self.send_status()

    def send_status(self, flush_lsn: int | None = None) -> None:
        """Send a standby status update; ``flush_lsn``, when given, becomes the position we report
        from now on (it never moves back). Only this reaches the slot's confirmed position."""
        if flush_lsn is not None and flush_lsn > self._flush_lsn:
            self._flush_lsn = flush_lsn
        lsn = self._flush_lsn
        clock = int(time.time() * 1_000_000) - PG_EPOCH_OFFSET_US
        conn = self._conn
        message = _STATUS.pack(b"r", lsn, lsn, lsn, clock, 0)
        while conn.put_copy_data(message) == 0:  # nonblocking and libpq's buffer is full
            time.sleep(0.001)
        while conn.flush() == 1:  # nonblocking: the rest is still queued
            time.sleep(0.001)
        self._last_status = time.monotonic()

    @property
    def flush_lsn(self) -> int:
        """The position the server has been told (0 before the first ``send_status`` with one)."""
        return self._flush_lsn

    def close(self) -> None:
        """Close the connection (safe to call twice)."""
        self._conn.finish()
