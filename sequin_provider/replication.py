"""Logical replication: prerequisites, publication and slot management, the change reader, heartbeats.

``ChangeReader`` reads complete transactions from a pgoutput slot starting at an offset (the end
LSN of the last transaction already taken) and acknowledges the slot only when told to
(``acknowledge``), which the stream app does once a micro-batch is durable (DESIGN §2.1, §6).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import psycopg
import psycopg2
import psycopg2.extras
from psycopg import sql

from sequin_provider.config import TableConfig
from sequin_provider.pgoutput import (
    Commit,
    LogicalMessage,
    PgOutputDecoder,
    Truncate,
    TypeInfo,
    TypeRegistry,
    int_to_lsn,
    lsn_to_int,
)

log = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "sequin:heartbeat"
MESSAGE_PREFIX = "sequin:"
# DateStyle/TimeZone/IntervalStyle of the walsender decide the text pgoutput sends (pgoutput.py).
REPLICATION_SESSION_OPTIONS = "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 -c extra_float_digits=1 -c bytea_output=hex"


PAUSED_STATUS_INTERVAL = 2.0
"""Seconds between status messages while the reader is paused by a full buffer.

psycopg2 (2.8.5+) confirms a keepalive's ``wal_end`` by itself when our last explicit flush is at
or past the start of the last data message it received. In the middle of a transaction that began
before our last acknowledgement, that could confirm past transactions we hold but have not
delivered. The walsender sends keepalives within a transaction only when it has not heard from us
for half of ``wal_sender_timeout``; regular status messages (psycopg2 sends one every 10 s while
reading, and this while paused) keep it from asking."""


class ReplicationError(RuntimeError):
    """A prerequisite or slot problem, with an actionable message."""


class SourceUnavailableError(ReplicationError):
    """The replication connection is gone because the source server stopped or is stopping."""


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
    return any(marker in text for marker in (
        "shutting down", "starting up", "not yet accepting", "connection refused", "terminating connection",
        "server closed the connection", "no connection to the server", "could not receive data",
        "could not send data"))  # not "could not connect" alone: a bad host or password must fail at once


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
        " WHERE n.nspname = %s AND c.relname = %s", (table.schema, table.name)).fetchone()
    if row is None or row[2] not in ("r", "p"):
        return None
    oid = int(row[0])
    return TableInfo(table.qualified, oid, tuple(primary_key_columns(conn, oid)), str(row[1]),
                     tuple(r[0] for r in conn.execute(
                         "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped"
                         " ORDER BY attnum", (oid,)).fetchall()))


def primary_key_columns(conn: psycopg.Connection[Any], relid: int) -> list[str]:
    """Primary key columns of a table, in key order."""
    rows = conn.execute(
        "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)"
        " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        " WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.ord", (relid,)).fetchall()
    return [r[0] for r in rows]


def check_prerequisites(conn: psycopg.Connection[Any], tables: Iterable[TableConfig]) -> tuple[list[str], list[str], dict[str, TableInfo]]:
    """(errors, warnings, table infos): everything that must hold before a slot is created."""
    errors: list[str] = []
    warnings: list[str] = []
    infos: dict[str, TableInfo] = {}
    version = server_version(conn)
    if version < 120000:
        errors.append(f"PostgreSQL {version // 10000} is not supported: 12 or newer is required")
    wal_level = conn.execute("SHOW wal_level").fetchone()[0]  # type: ignore[index]
    if wal_level != "logical":
        errors.append(f"wal_level is '{wal_level}', must be 'logical': run ALTER SYSTEM SET wal_level = logical; "
                      "then restart PostgreSQL")
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
            errors.append(f"table {table.qualified} has no primary key: add one (ALTER TABLE {table.qualified} "
                          "ADD PRIMARY KEY (...)); messages are grouped and identified by it")
        for col in table.group_column_names:
            if col not in info.columns:
                errors.append(f"table {table.qualified} has no column {col!r} (group_column_names)")
        if info.replica_identity == "n":
            errors.append(f"table {table.qualified} has REPLICA IDENTITY NOTHING: updates and deletes cannot be "
                          f"captured; run ALTER TABLE {table.qualified} REPLICA IDENTITY DEFAULT (or FULL)")
        elif info.replica_identity != "f":
            warnings.append(f"table {table.qualified} has REPLICA IDENTITY {'DEFAULT' if info.replica_identity == 'd' else 'USING INDEX'}: "
                            "updates carry changes = {} and deletes carry only the key; run ALTER TABLE "
                            f"{table.qualified} REPLICA IDENTITY FULL for old values")
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
        " FROM pg_replication_slots WHERE slot_name = %s", (name,)).fetchone()
    if row is None:
        return None
    return SlotInfo(row[0], row[1] or "", row[2] or "", bool(row[3]), row[4],
                    lsn_to_int(row[5]) if row[5] else None, lsn_to_int(row[6]) if row[6] else None,
                    None if row[7] is None else int(row[7]), None if row[8] is None else int(row[8]))


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
        raise ReplicationError(f"slot {name!r} is in use by another consumer (walsender pid {info.active_pid}); "
                               "stop it, or configure another slot name")
    return info


def ensure_publication(conn: psycopg.Connection[Any], name: str, tables: list[TableConfig], create: bool) -> bool:
    """Make sure publication ``name`` covers ``tables``; return True when it was created now."""
    exists = conn.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
    if exists is None:
        if not create:
            raise ReplicationError(f"publication {name!r} does not exist and create_if_not_exists is false: "
                                   f"CREATE PUBLICATION {name} FOR TABLE ...")
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
            sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(t.schema, t.name) for t in tables)))
        return True
    if exists[0]:
        return False
    present = {f"{s}.{t}" for s, t in conn.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (name,)).fetchall()}
    missing = [t for t in tables if t.qualified not in present]
    if missing:
        if not create:
            raise ReplicationError(f"publication {name!r} lacks {', '.join(t.qualified for t in missing)}")
        conn.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
            sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(t.schema, t.name) for t in missing)))
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
    conn.execute("INSERT INTO public.sequin_heartbeat (id, beat_at) VALUES (1, now())"
                 " ON CONFLICT (id) DO UPDATE SET beat_at = now()")
    conn.commit()


def emit_message(conn: psycopg.Connection[Any], prefix: str, content: str) -> None:
    """Commit a transactional logical message (in a transaction of its own), which the stream
    app receives at that commit's position (PG 14+: pgoutput's ``messages`` option)."""
    conn.execute("SELECT pg_logical_emit_message(true, %s, %s)", (prefix, content))
    if not conn.autocommit:
        conn.commit()


# ---------------------------------------------------------------------------------------------
# Reading


class _Catalog:
    """Type and primary-key lookups over a normal connection, for the decoder."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def type_info(self, oid: int) -> TypeInfo | None:
        row = self.conn.execute(
            "SELECT oid, typname, typtype, typcategory, typelem, typbasetype, typdelim FROM pg_type WHERE oid = %s",
            (oid,)).fetchone()
        if row is None:
            return None
        return TypeInfo(int(row[0]), row[1], row[2], row[3], int(row[4]), int(row[5]), row[6])

    def primary_key(self, relid: int, schema: str, name: str) -> list[str]:
        return primary_key_columns(self.conn, relid)

    def close(self) -> None:
        self.conn.close()


@dataclass
class ReadResult:
    """Complete transactions read: their change rows and the new offset."""

    rows: list[tuple] = field(default_factory=list)
    end_lsn: int = 0
    transactions: int = 0
    bytes: int = 0


@dataclass
class _Transaction:
    rows: list[tuple]
    end_lsn: int
    bytes: int


class ChangeReader:
    """Reads whole transactions from a logical slot (pgoutput) and acknowledges on demand.

    A background thread owns the replication connection: it decodes complete transactions into
    a bounded buffer while the caller processes the previous batch (decode overlaps delivery),
    and sends the acknowledgements it is asked for. Offsets are the end LSN of the last complete
    transaction handed out: starting replication there skips exactly the transactions already
    taken. The slot moves only through ``acknowledge``.
    """

    def __init__(self, dsn: str, slot: str, publication: str, buffer_rows: int = 400_000,
                 buffer_bytes: int = 512 * 1024 * 1024) -> None:
        self.dsn = dsn
        self.slot = slot
        self.publication = publication
        self.buffer_rows = buffer_rows
        self.buffer_bytes = buffer_bytes
        self.position: int | None = None  # end LSN of the last complete transaction handed out
        self._conn: Any = None
        self._cur: Any = None
        self._catalog: _Catalog | None = None
        self._heartbeat_conn: psycopg.Connection[Any] | None = None
        self._version = 0
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._ready: deque[_Transaction] = deque()
        self._ready_rows = 0
        self._ready_bytes = 0
        self._error: BaseException | None = None
        self._stop = False
        self._ack_wanted = 0
        self._ack_sent = 0

    # -- connection -------------------------------------------------------------------------
    def open(self, start_lsn: int, attempts: int = 30, unavailable_timeout: float = SOURCE_RETURN_TIMEOUT) -> None:
        """(Re)start replication at ``start_lsn``, retrying while a previous walsender lets go of the slot
        and, for up to ``unavailable_timeout`` seconds, while the source is down or restarting."""
        deadline = time.monotonic() + unavailable_timeout
        while True:
            try:
                return self._open(start_lsn, attempts)
            except (psycopg.OperationalError, ReplicationError) as exc:
                if not _is_unavailable(exc) or time.monotonic() >= deadline:
                    raise
                log.warning("source unavailable (%s); retrying replication at %s", str(exc).strip().splitlines()[0],
                            int_to_lsn(start_lsn))
                self.close()
                time.sleep(1.0)

    def _open(self, start_lsn: int, attempts: int) -> None:
        self.close()
        self._catalog = _Catalog(self.dsn)
        self._version = server_version(self._catalog.conn)
        decoder = PgOutputDecoder(TypeRegistry(self._catalog.type_info), self._catalog.primary_key)
        options = {"proto_version": "1", "publication_names": self.publication}
        if self._version >= 140000:
            options["messages"] = "true"
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                self._conn = psycopg2.connect(self.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection,
                                              options=REPLICATION_SESSION_OPTIONS)
                self._cur = self._conn.cursor()
                self._cur.start_replication(slot_name=self.slot, decode=False, start_lsn=int_to_lsn(start_lsn),
                                            options=options, status_interval=10)
                break
            except psycopg2.Error as exc:
                last = exc
                self._close_replication()
                text = str(exc)
                if "does not exist" in text:
                    raise ReplicationError(f"replication slot {self.slot!r} does not exist: run `sequin init`") from exc
                if "is active" not in text:
                    raise ReplicationError(f"cannot start replication on slot {self.slot!r}: {text.strip()}") from exc
                time.sleep(min(0.2 * (attempt + 1), 2.0))
        else:
            raise ReplicationError(f"slot {self.slot!r} stays in use by another consumer: {last}")
        self.position = start_lsn
        self._ready.clear()
        self._ready_rows = self._ready_bytes = 0
        self._error, self._stop = None, False
        self._ack_wanted = self._ack_sent = 0
        self._thread = threading.Thread(target=self._stream, args=(decoder,), name=f"sequin-reader-{self.slot}",
                                        daemon=True)
        self._thread.start()

    def _close_replication(self) -> None:
        for obj in (self._cur, self._conn):
            try:
                if obj is not None:
                    obj.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
        self._cur = self._conn = None

    def close(self) -> None:
        """Stop the reading thread and close every connection (safe to call twice)."""
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            thread.join(30)
            self._thread = None
        self._close_replication()
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
    def _stream(self, decoder: PgOutputDecoder) -> None:
        cur, conn, cond = self._cur, self._conn, self._cond
        pending: list[tuple] = []
        pending_bytes = 0
        last_status = time.monotonic()
        received = 0  # end LSN of the last complete transaction received
        last_progress = last_status  # when the acknowledged position last moved (or nothing was owed)
        acked = 0
        try:
            while True:
                with cond:
                    if self._stop:
                        return
                    wanted = self._ack_wanted
                    full = self._ready_rows >= self.buffer_rows or self._ready_bytes >= self.buffer_bytes
                if wanted > self._ack_sent:
                    cur.send_feedback(write_lsn=wanted, flush_lsn=wanted, apply_lsn=wanted, force=True)
                    with cond:
                        self._ack_sent = wanted
                        cond.notify_all()
                now = time.monotonic()
                if received <= self._ack_sent or self._ack_sent != acked:
                    last_progress, acked = now, self._ack_sent
                elif now - last_progress >= SHUTDOWN_PROBE_INTERVAL:
                    last_progress = now
                    if source_is_stopping(self.dsn):
                        conn.close()  # lets the walsender, and so the server's shutdown, finish
                        raise SourceUnavailableError(f"source server is shutting down; let go of slot {self.slot!r}")
                if full:
                    with cond:
                        cond.wait(0.05)
                    now = time.monotonic()
                    if now - last_status >= PAUSED_STATUS_INTERVAL:
                        # While paused we do not read, so psycopg2 sends no status; the walsender must
                        # keep hearing from us, or it asks for a reply with a keepalive that may land in
                        # the middle of a transaction, where psycopg2 would confirm the keepalive's
                        # wal_end on its own (see the note at PAUSED_STATUS_INTERVAL).
                        cur.send_feedback(force=True)
                        last_status = now
                    continue
                for _ in range(MESSAGES_PER_CHECK):  # the checks above take the lock: not per message
                    msg = cur.read_message()
                    if msg is None:
                        select.select([conn], [], [], 0.05)
                        time.sleep(ARRIVAL_PAUSE)
                        break
                    payload = msg.payload
                    event = decoder.decode(payload)
                    if type(event) is tuple:
                        pending.append(event)
                        pending_bytes += len(payload)
                    elif isinstance(event, Commit):
                        txn = _Transaction(pending, event.end_lsn, pending_bytes)
                        pending, pending_bytes = [], 0
                        received = event.end_lsn
                        with cond:
                            self._ready.append(txn)
                            self._ready_rows += len(txn.rows)
                            self._ready_bytes += txn.bytes
                            cond.notify_all()
                    elif isinstance(event, LogicalMessage):
                        if event.transactional and event.prefix.startswith(MESSAGE_PREFIX) and event.prefix != HEARTBEAT_PREFIX:
                            pending.append(decoder.message_row(event))
                    elif isinstance(event, Truncate):
                        pending.extend(decoder.truncate_rows(event))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer by read()/acknowledge()
            with cond:
                self._error = exc
                cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error = self._error
            if isinstance(error, ReplicationError):
                raise error
            if isinstance(error, psycopg2.OperationalError) and _is_unavailable(error):
                raise SourceUnavailableError(f"replication connection of slot {self.slot!r} lost: {error}") from error
            raise ReplicationError(f"replication stream of slot {self.slot!r} failed: {error}") from error

    # -- consuming --------------------------------------------------------------------------
    def read(self, max_rows: int, max_bytes: int, max_wait: float, stop_at: int | None = None,
             timeout: float = 600.0) -> ReadResult:
        """Take complete transactions from the buffer.

        Without ``stop_at``: return as soon as at least one transaction is ready, taking every
        ready one up to ``max_rows``/``max_bytes`` (whole transactions), or after ``max_wait``
        seconds with nothing. Batches thus grow with load (what accumulated while the caller was
        busy) and stay small when the stream is quiet. With ``stop_at`` (recovery): read exactly
        up to the transaction whose end LSN is ``stop_at``, waiting up to ``timeout`` seconds.
        """
        if self._thread is None:
            raise ReplicationError("read() before open()")
        result = ReadResult(end_lsn=self.position or 0)
        if stop_at is not None and stop_at == self.position:
            return result
        deadline = time.monotonic() + (timeout if stop_at is not None else max_wait)
        with self._cond:
            while True:
                self._raise_if_failed()
                while self._ready:
                    txn = self._ready[0]
                    if stop_at is None and result.transactions and (
                            len(result.rows) + len(txn.rows) > max_rows or result.bytes + txn.bytes > max_bytes):
                        return result
                    if stop_at is not None and txn.end_lsn > stop_at:
                        raise ReplicationError(f"re-read passed the recorded offset {int_to_lsn(stop_at)} "
                                               f"(transaction ending at {int_to_lsn(txn.end_lsn)})")
                    self._ready.popleft()
                    self._ready_rows -= len(txn.rows)
                    self._ready_bytes -= txn.bytes
                    result.rows.extend(txn.rows)
                    result.bytes += txn.bytes
                    result.transactions += 1
                    result.end_lsn = self.position = txn.end_lsn
                    self._cond.notify_all()  # room in the buffer
                    if stop_at is not None and txn.end_lsn == stop_at:
                        return result
                if stop_at is None and result.transactions:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if stop_at is not None:
                        raise ReplicationError(f"timed out re-reading up to {int_to_lsn(stop_at)}")
                    return result
                self._cond.wait(remaining)

    def heartbeat(self) -> None:
        """Emit a heartbeat through a normal connection to the source."""
        if self._heartbeat_conn is None or self._heartbeat_conn.closed:
            self._heartbeat_conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        emit_heartbeat(self._heartbeat_conn, self._version)

    def acknowledge(self, lsn: int, timeout: float = 30.0) -> None:
        """Tell the server everything up to ``lsn`` is durable; returns once the feedback is sent."""
        if self._thread is None:
            raise ReplicationError("acknowledge() without an open replication connection")
        deadline = time.monotonic() + timeout
        with self._cond:
            self._ack_wanted = max(self._ack_wanted, lsn)
            self._cond.notify_all()
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


def confirmed_flush_lsn(dsn: str, slot: str) -> int:
    """The slot's confirmed flush LSN (where a new stream starts)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        info = slot_info(conn, slot)
    if info is None:
        raise ReplicationError(f"replication slot {slot!r} does not exist: run `sequin init`")
    if info.confirmed_flush_lsn is None:
        raise ReplicationError(f"replication slot {slot!r} has no confirmed position (is it a logical slot?)")
    return info.confirmed_flush_lsn
