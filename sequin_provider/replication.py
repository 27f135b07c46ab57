"""Logical replication: prerequisites, publication and slot management, the change reader, heartbeats.

``ChangeReader`` reads complete transactions from a pgoutput slot starting at an offset (the end
LSN of the last transaction already taken) and acknowledges the slot only when told to
(``acknowledge``), which the stream app does once a micro-batch is durable (DESIGN §2.1, §6).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import psycopg
from psycopg import sql

from sequin_provider.config import TableConfig
from sequin_provider.exceptions import ReplicationError, SourceUnavailableError
from sequin_provider.pgoutput import (
    COMPILED,
    Commit,
    LogicalMessage,
    PgOutputDecoder,
    Truncate,
    TypeInfo,
    TypeRegistry,
    int_to_lsn,
    lsn_to_int,
)
from sequin_provider.pq_copy import libpq_copy_functions
from sequin_provider.replication_protocol import ReplicationProtocolError, ReplicationStream

log = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "sequin:heartbeat"
MESSAGE_PREFIX = "sequin:"
# DateStyle/TimeZone/IntervalStyle of the walsender decide the text pgoutput sends (pgoutput.py).
REPLICATION_SESSION_OPTIONS = (
    "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 -c extra_float_digits=1 -c bytea_output=hex"
)


PAUSED_STATUS_INTERVAL = 2.0
"""Seconds between status messages while the reader is paused by a full buffer: it reads nothing
then, and a walsender that hears nothing for ``wal_sender_timeout`` ends the connection. (A status
message only ever carries the position we acknowledged: ``replication_protocol``.)"""


# ``ReplicationError`` and ``SourceUnavailableError`` (the replication connection is gone because
# the source server stopped or is stopping) are defined in ``exceptions``.


SHUTDOWN_PROBE_INTERVAL = 2.0
"""Seconds without acknowledgement progress, while holding changes not yet acknowledged, after which
the reader checks whether the source is shutting down. A fast shutdown waits until every logical
consumer has confirmed everything sent; we confirm only what is delivered, and with the store on
the same server nothing can be delivered during the shutdown. So the reader lets go of the slot and
reconnects once the server is back (the changes are read again from the slot)."""
ARRIVAL_PAUSE = 0.001
"""Seconds the reading thread waits after the socket turned readable, so that the next read takes
what the walsender sent meanwhile in one go. Without it the thread, faster than the walsender, woke
for every message or few: decoding a backlog alone (a /tmp script, 300,000 changes) cost 1.5-2.3 us
of system CPU per change in this process, 0.2-0.5 with it, user CPU 2.6 -> 2.0-2.4 us, and the
walsender, which no longer wakes a waiting reader with each send, went 143-151k -> 153-194k
changes/s. It adds at most a millisecond to a change's latency."""
MESSAGES_PER_CHECK = 256
"""Messages the reading thread takes in a row before it looks again for a stop, an acknowledgement
to send and a full buffer (under the lock): taking the lock for every message was a quarter of the
reader's Python time. The buffer may overshoot its bounds by this many rows."""

TEST_STALL_ENV = "SEQUIN_TEST_READER_STALL"
"""Tests only: seconds the reading thread freezes, once, right after it read a data message that
starts at or below the position it last acknowledged while it holds transactions not acknowledged
yet: a GC pause or a frozen VM at the one moment a keepalive is dangerous (``StatusReporter``)."""

SOURCE_RETURN_TIMEOUT = 120.0
"""Seconds ``open`` waits for an unreachable or restarting source to accept replication again."""


def source_is_stopping(dsn: str) -> bool:
    """Whether the server refuses new connections because it is shutting down (or not up)."""
    try:
        with psycopg.connect(dsn, connect_timeout=3):
            return False
    except psycopg.OperationalError as exc:
        return _is_unavailable(exc)


def _is_unavailable(exc: BaseException) -> bool:
    """A connection error that means the server is down, starting, stopping or unreachable."""
    text = str(exc).lower()
    return any(
        marker in text
        for marker in (
            "shutting down",
            "starting up",
            "not yet accepting",
            "connection refused",
            "terminating connection",
            "server closed the connection",
            "no connection to the server",
            "could not receive data",
            "could not send data",
        )
    )  # not "could not connect" alone: a bad host or password must fail at once


# ---------------------------------------------------------------------------------------------
# Prerequisites, publication, slot


@dataclass(frozen=True)
class TableInfo:
    """Catalog facts about a captured table."""

    qualified: str
    oid: int
    primary_key: tuple[str, ...]
    replica_identity: str  # d default, f full, i index, n nothing
    columns: tuple[str, ...]


def server_version(conn: psycopg.Connection[Any]) -> int:
    """``server_version_num`` (e.g. 150004)."""
    return int(conn.execute("SHOW server_version_num").fetchone()[0])  # type: ignore[index]


def table_info(conn: psycopg.Connection[Any], table: TableConfig) -> TableInfo | None:
    """Catalog facts of ``table`` or None when it does not exist."""
    row = conn.execute(
        "SELECT c.oid, c.relreplident, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s",
        (table.schema, table.name),
    ).fetchone()
    if row is None or row[2] not in ("r", "p"):
        return None
    oid = int(row[0])
    return TableInfo(
        table.qualified,
        oid,
        tuple(primary_key_columns(conn, oid)),
        str(row[1]),
        tuple(
            r[0]
            for r in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped"
                " ORDER BY attnum",
                (oid,),
            ).fetchall()
        ),
    )


def primary_key_columns(conn: psycopg.Connection[Any], relid: int) -> list[str]:
    """Primary key columns of a table, in key order."""
    rows = conn.execute(
        "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)"
        " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        " WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.ord",
        (relid,),
    ).fetchall()
    return [r[0] for r in rows]


def check_prerequisites(
    conn: psycopg.Connection[Any], tables: Iterable[TableConfig]
) -> tuple[list[str], list[str], dict[str, TableInfo]]:
    """(errors, warnings, table infos): everything that must hold before a slot is created."""
    errors: list[str] = []
    warnings: list[str] = []
    infos: dict[str, TableInfo] = {}
    version = server_version(conn)
    if version < 120000:
        errors.append(f"PostgreSQL {version // 10000} is not supported: 12 or newer is required")
    wal_level = conn.execute("SHOW wal_level").fetchone()[0]  # type: ignore[index]
    if wal_level != "logical":
        errors.append(
            f"wal_level is '{wal_level}', must be 'logical': run ALTER SYSTEM SET wal_level = logical; "
            "then restart PostgreSQL"
        )
    encoding = conn.execute("SHOW server_encoding").fetchone()[0]  # type: ignore[index]
    if encoding != "UTF8":
        errors.append(f"server_encoding is {encoding}: only UTF8 databases are supported")
    for table in tables:
        info = table_info(conn, table)
        if info is None:
            errors.append(f"table {table.qualified} does not exist (or is not a table)")
            continue
        infos[table.qualified] = info
        if not info.primary_key:
            errors.append(
                f"table {table.qualified} has no primary key: add one (ALTER TABLE {table.qualified} "
                "ADD PRIMARY KEY (...)); messages are grouped and identified by it"
            )
        for col in table.group_column_names:
            if col not in info.columns:
                errors.append(f"table {table.qualified} has no column {col!r} (group_column_names)")
        if info.replica_identity == "n":
            errors.append(
                f"table {table.qualified} has REPLICA IDENTITY NOTHING: updates and deletes cannot be "
                f"captured; run ALTER TABLE {table.qualified} REPLICA IDENTITY DEFAULT (or FULL)"
            )
        elif info.replica_identity != "f":
            warnings.append(
                f"table {table.qualified} has REPLICA IDENTITY {'DEFAULT' if info.replica_identity == 'd' else 'USING INDEX'}: "
                "updates carry changes = {} and deletes carry only the key; run ALTER TABLE "
                f"{table.qualified} REPLICA IDENTITY FULL for old values"
            )
    return errors, warnings, infos


@dataclass(frozen=True)
class SlotInfo:
    """A replication slot's position and state."""

    name: str
    plugin: str
    database: str
    active: bool
    active_pid: int | None
    confirmed_flush_lsn: int | None
    restart_lsn: int | None
    lag_bytes: int | None
    retained_bytes: int | None


def slot_info(conn: psycopg.Connection[Any], name: str) -> SlotInfo | None:
    """State of slot ``name`` or None."""
    row = conn.execute(
        "SELECT slot_name, plugin, database, active, active_pid, confirmed_flush_lsn::text, restart_lsn::text,"
        " pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,"
        " pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint"
        " FROM pg_replication_slots WHERE slot_name = %s",
        (name,),
    ).fetchone()
    if row is None:
        return None
    return SlotInfo(
        row[0],
        row[1] or "",
        row[2] or "",
        bool(row[3]),
        row[4],
        lsn_to_int(row[5]) if row[5] else None,
        lsn_to_int(row[6]) if row[6] else None,
        None if row[7] is None else int(row[7]),
        None if row[8] is None else int(row[8]),
    )


def check_slot_usable(conn: psycopg.Connection[Any], name: str) -> SlotInfo | None:
    """Raise when slot ``name`` exists but cannot be ours (other plugin, database, or in use)."""
    info = slot_info(conn, name)
    if info is None:
        return None
    dbname = conn.info.dbname
    if info.plugin != "pgoutput":
        raise ReplicationError(f"slot {name!r} uses plugin {info.plugin!r}, not pgoutput: pick another slot name")
    if info.database != dbname:
        raise ReplicationError(f"slot {name!r} belongs to database {info.database!r}, not {dbname!r}")
    if info.active:
        raise ReplicationError(
            f"slot {name!r} is in use by another consumer (walsender pid {info.active_pid}); "
            "stop it, or configure another slot name"
        )
    return info


def ensure_publication(conn: psycopg.Connection[Any], name: str, tables: list[TableConfig], create: bool) -> bool:
    """Make sure publication ``name`` covers ``tables``; return True when it was created now."""
    exists = conn.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
    if exists is None:
        if not create:
            raise ReplicationError(
                f"publication {name!r} does not exist and create_if_not_exists is false: "
                f"CREATE PUBLICATION {name} FOR TABLE ..."
            )
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(t.schema, t.name) for t in tables)
            )
        )
        return True
    if exists[0]:
        return False
    present = {
        f"{s}.{t}"
        for s, t in conn.execute(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (name,)
        ).fetchall()
    }
    missing = [t for t in tables if t.qualified not in present]
    if missing:
        if not create:
            raise ReplicationError(f"publication {name!r} lacks {', '.join(t.qualified for t in missing)}")
        conn.execute(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(t.schema, t.name) for t in missing)
            )
        )
    return False


def create_slot(conn: psycopg.Connection[Any], name: str) -> int:
    """Create logical slot ``name`` (pgoutput); return its confirmed flush LSN."""
    row = conn.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (name,)).fetchone()
    return lsn_to_int(row[0])  # type: ignore[index]


def emit_heartbeat(conn: psycopg.Connection[Any], version: int, content: str = "") -> None:
    """Write a transactional heartbeat into the WAL so an idle database's slot can advance.

    PG 14+: a logical message. Below: an upsert into ``sequin_heartbeat`` (in the publication).
    """
    if version >= 140000:
        emit_message(conn, HEARTBEAT_PREFIX, content or "{}")
        return
    conn.execute(
        "INSERT INTO public.sequin_heartbeat (id, beat_at) VALUES (1, now())"
        " ON CONFLICT (id) DO UPDATE SET beat_at = now()"
    )
    conn.commit()


def emit_message(conn: psycopg.Connection[Any], prefix: str, content: str) -> None:
    """Commit a transactional logical message (in a transaction of its own), which the stream
    app receives at that commit's position (PG 14+: pgoutput's ``messages`` option)."""
    conn.execute("SELECT pg_logical_emit_message(true, %s, %s)", (prefix, content))
    if not conn.autocommit:
        conn.commit()


# ---------------------------------------------------------------------------------------------
# Reading


class Catalog:
    """Type and primary-key lookups over a normal connection, for the decoder."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def type_info(self, oid: int) -> TypeInfo | None:
        row = self.conn.execute(
            "SELECT oid, typname, typtype, typcategory, typelem, typbasetype, typdelim FROM pg_type WHERE oid = %s",
            (oid,),
        ).fetchone()
        if row is None:
            return None
        return TypeInfo(int(row[0]), row[1], row[2], row[3], int(row[4]), int(row[5]), row[6])

    def primary_key(self, relid: int, schema: str, name: str) -> list[str]:
        return primary_key_columns(self.conn, relid)

    def close(self) -> None:
        self.conn.close()


Position = tuple[int, int]
"""A place in the change stream: ``(lsn, idx)`` is after every transaction that ends at or before
``lsn`` (an end LSN) and after the first ``idx`` rows of the transaction that follows it. ``idx``
is 0 at a commit boundary; a transaction larger than a chunk spans several micro-batches, whose
offsets then carry an ``idx`` (DESIGN §6). The slot is only ever acknowledged at an ``lsn``."""


def as_position(value: int | Position) -> Position:
    """An end LSN alone is the commit boundary ``(lsn, 0)``."""
    return (value, 0) if isinstance(value, int) else (int(value[0]), int(value[1]))


@dataclass
class ReadResult:
    """Rows read (whole transactions and chunks of an open one) and the position after them."""

    rows: list[tuple] = field(default_factory=list)
    end_lsn: int = 0
    end_idx: int = 0
    transactions: int = 0  # transactions completed in these rows
    bytes: int = 0

    @property
    def end(self) -> Position:
        """The position after these rows."""
        return (self.end_lsn, self.end_idx)


@dataclass
class _Chunk:
    """Consecutive rows of one transaction: rows ``first_idx…`` of the transaction following the
    commit boundary ``base_lsn``; ``commit_lsn`` is the end LSN of its commit when the chunk is the
    transaction's last (0 while the transaction is still open after it)."""

    base_lsn: int
    first_idx: int
    rows: list[tuple]
    bytes: int
    commit_lsn: int = 0

    @property
    def end(self) -> Position:
        return (self.commit_lsn, 0) if self.commit_lsn else (self.base_lsn, self.first_idx + len(self.rows))

    def split(self, count: int) -> _Chunk:
        """Keep the first ``count`` rows here (the transaction goes on after them); return the rest."""
        share = self.bytes * count // max(len(self.rows), 1)
        rest = _Chunk(self.base_lsn, self.first_idx + count, self.rows[count:], self.bytes - share, self.commit_lsn)
        self.rows, self.bytes, self.commit_lsn = self.rows[:count], share, 0
        return rest


CHUNK_ROWS = 50_000
"""Rows of an open transaction the reading thread gathers before it hands them on as a chunk, so
that memory does not grow with the size of a transaction (DESIGN §2.7): a 2,000,000-row UPDATE
in one transaction held ~1.6 KB per row until its commit when whole transactions were the unit."""
CHUNK_BYTES = 64 * 1024 * 1024
"""Or this many bytes of pgoutput payload, whichever comes first."""


class ChangeReader:
    """Reads a logical slot (pgoutput) in commit order and acknowledges it on demand.

    A background thread owns the replication connection (``replication_protocol``): it decodes
    transactions into a bounded buffer of chunks while the caller processes the previous batch
    (decode overlaps delivery), and sends the acknowledgements it is asked for and nothing else.
    A small transaction is one chunk; a large one is cut into chunks of ``chunk_rows`` rows, so
    neither the thread nor the buffer holds more than a chunk of an open transaction. Positions
    (``Position``) are the end LSN of the last complete transaction handed out and the rows of the
    next one handed out after it: starting replication at that LSN and skipping those rows resumes
    exactly there. The slot moves only through ``acknowledge``, and only to commit boundaries.
    """

    def __init__(
        self,
        dsn: str,
        slot: str,
        publication: str,
        buffer_rows: int = 400_000,
        buffer_bytes: int = 512 * 1024 * 1024,
        chunk_rows: int = CHUNK_ROWS,
        chunk_bytes: int = CHUNK_BYTES,
        compiled: bool = COMPILED,
    ) -> None:
        self.dsn = dsn
        self.compiled = compiled
        """Decode with the compiled hot path (``pgoutput.PgOutputDecoder``) and read with its loop
        (``ReplicationStream.read_rows``), or with their Python references (tests compare the two)."""
        self.slot = slot
        self.publication = publication
        self.buffer_rows = buffer_rows
        self.buffer_bytes = buffer_bytes
        self.chunk_rows = max(1, chunk_rows)
        self.chunk_bytes = max(1, chunk_bytes)
        self.position: Position | None = None  # the position after the last rows handed out
        self._stream_conn: ReplicationStream | None = None
        self._catalog: Catalog | None = None
        self._heartbeat_conn: psycopg.Connection[Any] | None = None
        self._version = 0
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._ready: deque[_Chunk] = deque()
        self._ready_rows = 0
        self._ready_bytes = 0
        self._error: BaseException | None = None
        self._stop = False
        self._ack_wanted = 0
        self._ack_sent = 0
        self._wake: tuple[int, int] | None = None
        """A pipe whose read end the reading thread selects on beside the socket: ``acknowledge``
        and ``close`` write to it, so the thread acts on them at once instead of when the socket
        next turns readable or its 50 ms wait ends (measured: ``acknowledge`` took 5-50 ms, 28 on
        average, inside every micro-batch's offset commit at 5,000 changes/s)."""
        self.test_stall = float(os.environ.get(TEST_STALL_ENV) or 0)

    # -- connection -------------------------------------------------------------------------
    def open(
        self, start: int | Position, attempts: int = 30, unavailable_timeout: float = SOURCE_RETURN_TIMEOUT
    ) -> None:
        """(Re)start replication at ``start`` (an end LSN, or a ``Position`` inside a transaction),
        retrying while a previous walsender lets go of the slot and, for up to
        ``unavailable_timeout`` seconds, while the source is down or restarting."""
        position = as_position(start)
        deadline = time.monotonic() + unavailable_timeout
        while True:
            try:
                return self._open(position, attempts)
            except (psycopg.OperationalError, ReplicationError) as exc:
                if not _is_unavailable(exc) or time.monotonic() >= deadline:
                    raise
                log.warning(
                    "source unavailable (%s); retrying replication at %s",
                    str(exc).strip().splitlines()[0],
                    int_to_lsn(position[0]),
                )
                self.close()
                time.sleep(1.0)

    def _open(self, position: Position, attempts: int) -> None:
        self.close()
        self._catalog = Catalog(self.dsn)
        self._version = server_version(self._catalog.conn)
        decoder = PgOutputDecoder(TypeRegistry(self._catalog.type_info), self._catalog.primary_key, self.compiled)
        options = {"proto_version": "1", "publication_names": self.publication}
        if self._version >= 140000:
            options["messages"] = "true"
        last: Exception | None = None
        for attempt in range(attempts):
            stream: ReplicationStream | None = None
            try:
                stream = ReplicationStream(self.dsn, REPLICATION_SESSION_OPTIONS)
                stream.start(self.slot, int_to_lsn(position[0]), options)
                self._stream_conn = stream
                break
            except ReplicationProtocolError as exc:
                last = exc
                if stream is not None:
                    stream.close()
                text = str(exc)
                if "does not exist" in text:
                    raise ReplicationError(f"replication slot {self.slot!r} does not exist: run `sequin init`") from exc
                if "is active" not in text:
                    if _is_unavailable(exc):
                        raise
                    raise ReplicationError(f"cannot start replication on slot {self.slot!r}: {text.strip()}") from exc
                time.sleep(min(0.2 * (attempt + 1), 2.0))
        else:
            raise ReplicationError(f"slot {self.slot!r} stays in use by another consumer: {last}")
        self.position = position
        self._ready.clear()
        self._ready_rows = self._ready_bytes = 0
        self._error, self._stop = None, False
        self._ack_wanted = self._ack_sent = 0
        if self._wake is None:
            self._wake = os.pipe()
            os.set_blocking(self._wake[0], False)
            os.set_blocking(self._wake[1], False)
        self._thread = threading.Thread(
            target=self._stream, args=(decoder, position), daemon=True, name=f"sequin-reader-{self.slot}"
        )
        self._thread.start()

    def _close_replication(self) -> None:
        if self._stream_conn is not None:
            try:
                self._stream_conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
        self._stream_conn = None

    def close(self) -> None:
        """Stop the reading thread and close every connection (safe to call twice)."""
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._wake_thread()
            thread.join(30)
            self._thread = None
        self._close_replication()
        if self._wake is not None and (thread is None or not thread.is_alive()):
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        for attr in ("_catalog", "_heartbeat_conn"):
            obj = getattr(self, attr)
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # noqa: BLE001
                    pass
                setattr(self, attr, None)

    @property
    def is_open(self) -> bool:
        """True while the reading thread streams from the slot."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # -- the reading thread -----------------------------------------------------------------
    def _wake_thread(self) -> None:
        """Have the reading thread look at once for an acknowledgement to send or a stop."""
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")
            except (BlockingIOError, OSError):  # full (it will wake anyway) or closed
                pass

    def _stream(self, decoder: PgOutputDecoder, start: Position) -> None:
        stream, cond, wake = self._stream_conn, self._cond, self._wake
        assert stream is not None and wake is not None
        boundary, skip = start  # the first transaction's first ``skip`` rows were handed out before
        first_idx, pending, pending_bytes = skip, [], 0
        chunk_rows, chunk_bytes = self.chunk_rows, self.chunk_bytes
        received = 0  # end LSN of the last complete transaction received (0: none yet)
        last_progress = time.monotonic()  # when the acknowledged position last moved (or nothing was owed)
        acked = 0
        stall = self.test_stall
        change_row = decoder.change_row
        take_rows = decoder.take_rows if libpq_copy_functions() is not None else None

        def wait_for_data() -> None:
            """Until the socket is readable (then ``ARRIVAL_PAUSE`` more) or ``acknowledge``/``close`` wake us."""
            readable = select.select([stream, wake[0]], [], [], 0.05)[0]
            if wake[0] in readable:
                try:
                    os.read(wake[0], 4096)
                except BlockingIOError:
                    pass
            else:
                time.sleep(ARRIVAL_PAUSE)

        def hand_on(commit_lsn: int = 0) -> None:
            nonlocal first_idx, pending, pending_bytes
            chunk = _Chunk(boundary, first_idx, pending, pending_bytes, commit_lsn)
            first_idx = 0 if commit_lsn else first_idx + len(pending)
            pending, pending_bytes = [], 0
            with cond:
                self._ready.append(chunk)
                self._ready_rows += len(chunk.rows)
                self._ready_bytes += chunk.bytes
                cond.notify_all()

        try:
            while True:
                with cond:
                    if self._stop:
                        return
                    wanted = self._ack_wanted
                    full = self._ready_rows >= self.buffer_rows or self._ready_bytes >= self.buffer_bytes
                if wanted > self._ack_sent:
                    stream.send_status(wanted)
                    with cond:
                        self._ack_sent = wanted
                        cond.notify_all()
                now = time.monotonic()
                if received <= self._ack_sent or self._ack_sent != acked:
                    last_progress, acked = now, self._ack_sent
                elif now - last_progress >= SHUTDOWN_PROBE_INTERVAL:
                    last_progress = now
                    if source_is_stopping(self.dsn):
                        stream.close()  # lets the walsender, and so the server's shutdown, finish
                        raise SourceUnavailableError(f"source server is shutting down; let go of slot {self.slot!r}")
                if full:
                    with cond:
                        cond.wait(0.05)
                    stream.send_status_if_due(PAUSED_STATUS_INTERVAL)  # we read nothing while paused
                    continue
                budget = MESSAGES_PER_CHECK  # the checks above take the lock: not per message
                while budget > 0:
                    if take_rows is not None and not skip and not stall and len(pending) < chunk_rows:
                        # the compiled loop takes the plain rows (nearly every message) until a limit,
                        # an empty buffer or a message it leaves to the lines below
                        before = len(pending)
                        room, room_bytes = min(budget, chunk_rows - before), chunk_bytes - pending_bytes
                        added, message = stream.read_rows(take_rows, pending, room, room_bytes)
                        taken = len(pending) - before
                        budget -= taken
                        pending_bytes += added
                        if len(pending) >= chunk_rows or pending_bytes >= chunk_bytes:
                            hand_on()
                        if message is None:
                            if taken >= room or added >= room_bytes:  # a limit, not an empty buffer
                                continue
                            wait_for_data()
                            break
                    else:
                        message = stream.read()
                        if message is None:
                            wait_for_data()
                            break
                    budget -= 1
                    data_start, payload = message
                    if stall and data_start <= self._ack_sent < received:
                        stream.send_status()  # the walsender's timeout counts from the stall's start
                        time.sleep(stall)
                        stall = 0.0
                    try:
                        event = change_row(payload)  # nearly every message; None: decode() takes it
                    except Exception:  # noqa: BLE001 - decode() raises it again, as a DecodeError that says so
                        event = None
                    if event is None:
                        event = decoder.decode(payload)
                    if type(event) is tuple:
                        if skip:
                            skip -= 1
                            continue
                        pending.append(event)
                        pending_bytes += len(payload)
                        if len(pending) >= chunk_rows or pending_bytes >= chunk_bytes:
                            hand_on()
                    elif isinstance(event, Commit):
                        hand_on(event.end_lsn)
                        received = boundary = event.end_lsn
                        skip = 0
                    elif isinstance(event, LogicalMessage):
                        if (
                            event.transactional
                            and event.prefix.startswith(MESSAGE_PREFIX)
                            and event.prefix != HEARTBEAT_PREFIX
                        ):
                            row = decoder.message_row(event)  # numbered even when skipped
                            if skip:
                                skip -= 1
                                continue
                            pending.append(row)
                    elif isinstance(event, Truncate):
                        for row in decoder.truncate_rows(event):  # numbered even when skipped
                            if skip:
                                skip -= 1
                            else:
                                pending.append(row)
                stream.send_status_if_due()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer by read()/acknowledge()
            with cond:
                self._error = exc
                cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error = self._error
            if isinstance(error, ReplicationError):
                raise error
            if isinstance(error, psycopg.OperationalError) and _is_unavailable(error):
                raise SourceUnavailableError(f"replication connection of slot {self.slot!r} lost: {error}") from error
            raise ReplicationError(f"replication stream of slot {self.slot!r} failed: {error}") from error

    # -- consuming --------------------------------------------------------------------------
    def read(
        self,
        max_rows: int,
        max_bytes: int,
        max_wait: float,
        stop_at: int | Position | None = None,
        timeout: float = 600.0,
    ) -> ReadResult:
        """Take chunks (whole small transactions, or parts of a large one) from the buffer.

        Without ``stop_at``: return as soon as at least one chunk is ready, taking every ready one
        up to ``max_rows``/``max_bytes`` (whole chunks), or after ``max_wait`` seconds with
        nothing. Batches thus grow with load (what accumulated while the caller was busy) and stay
        small when the stream is quiet. With ``stop_at`` (recovery): read exactly up to that
        position, waiting up to ``timeout`` seconds.
        """
        if self._thread is None or self.position is None:
            raise ReplicationError("read() before open()")
        target = None if stop_at is None else as_position(stop_at)
        result = ReadResult(end_lsn=self.position[0], end_idx=self.position[1])
        if target is not None and target == self.position:
            return result
        deadline = time.monotonic() + (timeout if target is not None else max_wait)
        taken = 0
        with self._cond:
            while True:
                self._raise_if_failed()
                while self._ready:
                    chunk = self._ready[0]
                    if (
                        target is None
                        and taken
                        and (len(result.rows) + len(chunk.rows) > max_rows or result.bytes + chunk.bytes > max_bytes)
                    ):
                        return result
                    if target is not None and chunk.end > target:
                        if chunk.base_lsn != target[0] or target[1] < chunk.first_idx:
                            raise ReplicationError(
                                f"re-read passed the recorded offset {_describe(target)} "
                                f"(chunk ending at {_describe(chunk.end)})"
                            )
                        self._ready[0] = chunk.split(target[1] - chunk.first_idx)
                        self._ready_rows -= len(chunk.rows)
                        self._ready_bytes -= chunk.bytes
                        self._ready.appendleft(chunk)
                    self._ready.popleft()
                    self._ready_rows -= len(chunk.rows)
                    self._ready_bytes -= chunk.bytes
                    result.rows.extend(chunk.rows)
                    result.bytes += chunk.bytes
                    result.transactions += 1 if chunk.commit_lsn else 0
                    result.end_lsn, result.end_idx = self.position = chunk.end
                    taken += 1
                    self._cond.notify_all()  # room in the buffer
                    if target is not None and chunk.end == target:
                        return result
                if target is None and taken:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if target is not None:
                        raise ReplicationError(f"timed out re-reading up to {_describe(target)}")
                    return result
                self._cond.wait(remaining)

    def heartbeat(self) -> None:
        """Emit a heartbeat through a normal connection to the source."""
        if self._heartbeat_conn is None or self._heartbeat_conn.closed:
            self._heartbeat_conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        emit_heartbeat(self._heartbeat_conn, self._version)

    def acknowledge(self, lsn: int, timeout: float = 30.0) -> None:
        """Tell the server everything up to the commit boundary ``lsn`` is durable; returns once
        the status update is sent. This is the only position the server ever hears from us."""
        if self._thread is None:
            raise ReplicationError("acknowledge() without an open replication connection")
        deadline = time.monotonic() + timeout
        with self._cond:
            self._ack_wanted = max(self._ack_wanted, lsn)
            self._cond.notify_all()
            self._wake_thread()
            while self._ack_sent < lsn:
                self._raise_if_failed()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReplicationError(f"acknowledging {int_to_lsn(lsn)} timed out")
                self._cond.wait(remaining)

    @property
    def server_version(self) -> int:
        """Server version of the source (after ``open``)."""
        return self._version


def _describe(position: Position) -> str:
    return int_to_lsn(position[0]) + (f" + {position[1]} rows" if position[1] else "")


def confirmed_flush_lsn(dsn: str, slot: str) -> int:
    """The slot's confirmed flush LSN (where a new stream starts)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        info = slot_info(conn, slot)
    if info is None:
        raise ReplicationError(f"replication slot {slot!r} does not exist: run `sequin init`")
    if info.confirmed_flush_lsn is None:
        raise ReplicationError(f"replication slot {slot!r} has no confirmed position (is it a logical slot?)")
    return info.confirmed_flush_lsn
