"""The replication stream as a Spark Python data source (``format("sequin_replication")``).

The stream reader lives in one long-lived driver-side Python process and holds the replication
connection (``replication.ChangeReader``) across micro-batches. ``latestOffset`` takes the complete
transactions decoded so far and spools them as an Arrow IPC file; the batch's partition names
that file and the executor maps it (``read``), which is much cheaper than handing the rows to the
JVM through the driver. After a crash the files are still there, so Spark's replay of an
unfinished batch needs no slot; only when a file is missing is the range re-read from the slot.
``commit(end)`` is the only place the slot is acknowledged, and it removes the batch's files.

Offsets are ``{"lsn": <end LSN of the last complete transaction>}``, with ``"idx": <rows of the next
transaction taken>`` when a batch ends inside a large transaction (``replication.Position``): such a
transaction spans several micro-batches, its last batch carries a marker row
(``messages.open_transaction_row``) so that the pipeline keeps its rows invisible until it is whole,
and the slot is acknowledged only at ``lsn``.

Options: ``config`` (path of sequin.yaml), ``database``, ``spool`` (a folder of this database
that the executors can read; the app passes ``<checkpoint>/sequin-spool`` or
``stream.spool_location/<database>``), ``partitions`` (slices per large batch), ``payload``
(``full``, the default: every change column; ``spool``: one row per slice of the spool file, its
path, first row and row count, from which the executors' writers take the change rows and select
them: no change row crosses into the JVM). The DSN is resolved from the config in the reader's process,
so it never appears in Spark plans.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from sequin_provider import store
from sequin_provider.backfill.watermarks import (
    HIGH_PREFIX,
    WindowTracker,
    holdable,
    parse_watermark,
    read_rows,
)
from sequin_provider.change_arrow import CHANGE_ARROW_SCHEMA, rows_to_arrow
from sequin_provider.config import DatabaseConfig, SequinConfig, StreamConfig, load_config
from sequin_provider.logs import configure_logging
from sequin_provider.messages import CHANGE_SCHEMA_DDL, open_transaction_row
from sequin_provider.replication import (
    CHUNK_BYTES,
    CHUNK_ROWS,
    ChangeReader,
    Position,
    ReadResult,
    SourceUnavailableError,
    confirmed_flush_lsn,
)
from sequin_provider.sinks.sequin_stream import SequinStreamSink
from sequin_provider.spark.spool import (
    make_folder,
    remove_spooled,
    spool_path,
    spool_table,
    spooled_end,
    write_spool,
)
from sequin_provider.spark.worker_heap import freeze_long_lived, keep_heap_pages

log = logging.getLogger(__name__)

MIN_ROWS_PER_SLICE = 10_000
MARKS_ONLY_BATCH_INTERVAL = 5.0
"""Seconds between micro-batches that would carry only logical messages (backfill watermarks,
heartbeats): a backfill emits several per second, and each micro-batch costs the JVM about as
much as a backfill page costs the store. Such a batch is held open (the windows in it still close
at once) until a change, a backfill's Spark-path read or the high watermark ending a range arrives,
or until this long after the last batch (``watermarks.holdable``)."""
READER_GC_THRESHOLDS = (100_000, 10, 10)
"""Cyclic GC thresholds of the reader's process. Each change is a tuple holding two lists, and a
batch holds up to ``stream.max_batch_rows`` of them: at Python's default (a young collection every
700 allocations) the collector spent more time walking them than the compiled decoder spent
decoding (2.75 against 1.18 us per change, measured in one process). Nothing in the reader makes
reference cycles in bulk; a young collection every 100,000 allocations is still frequent."""
SPOOL_SLICE_SCHEMA = pa.schema(
    [pa.field("spool_path", pa.string()), pa.field("spool_offset", pa.int64()), pa.field("spool_rows", pa.int64())]
)
"""A ``payload=spool`` row: a slice of a batch's spool file (the executors' writers read its rows)."""
SPOOL_SLICE_DDL = "spool_path string, spool_offset bigint, spool_rows bigint"


class SequinReplicationDataSource(DataSource):
    """Change rows (``messages.CHANGE_COLUMNS``) of one database's replication slot."""

    @classmethod
    def name(cls) -> str:
        return "sequin_replication"

    def schema(self) -> str:
        return SPOOL_SLICE_DDL if self.options.get("payload") == "spool" else CHANGE_SCHEMA_DDL

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return ReplicationStreamReader(dict(self.options))


class SpoolPartition(InputPartition):
    """A slice of one micro-batch: the offset range, its spool file, and which rows of it."""

    def __init__(
        self,
        start: Position,
        end: Position,
        path: str,
        options: dict[str, str],
        offset: int = 0,
        length: int | None = None,
    ) -> None:
        super().__init__(None)
        self.start = start
        self.end = end
        self.path = path
        self.options = options
        self.offset = offset
        self.length = length  # None: every row (and the only partition of the batch)


def offset_position(offset: dict) -> Position:
    """A source offset as a ``Position`` (offsets of earlier versions have no ``idx``)."""
    return int(offset["lsn"]), int(offset.get("idx", 0))


def position_offset(position: Position) -> dict:
    """A ``Position`` as a source offset (``idx`` only inside a transaction)."""
    return {"lsn": position[0], "idx": position[1]} if position[1] else {"lsn": position[0]}


def spool_slice(path: str, offset: int, rows: int) -> Iterator[pa.RecordBatch]:
    """The ``payload=spool`` row naming ``rows`` rows of the spool file ``path`` from ``offset``
    (nothing for an empty slice)."""
    if rows > 0:
        yield pa.RecordBatch.from_arrays(
            [pa.array([path]), pa.array([offset], pa.int64()), pa.array([rows], pa.int64())], schema=SPOOL_SLICE_SCHEMA
        )


SLICE_CHUNK_ROWS = 20_000
"""Rows per Arrow batch a slice is handed on in (as Spark's ``arrow.maxRecordsPerBatch`` in the
app): a writer renders the next chunk while the store copies the last."""


def spool_slice_rows(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    """The change rows of each slice a batch of ``payload=spool`` rows names, in order."""
    for path, offset, rows in zip(
        batch.column("spool_path").to_pylist(),
        batch.column("spool_offset").to_pylist(),
        batch.column("spool_rows").to_pylist(),
    ):
        table = spool_table(path).slice(offset, rows).combine_chunks()
        yield from table.to_batches(max_chunksize=SLICE_CHUNK_ROWS) if table.num_rows else ()


def with_open_transaction(rows: list[tuple], last: ReadResult) -> list[tuple]:
    """A batch's rows, and the marker row of the transaction it ends inside, if it does
    (``messages.open_transaction_row``; the same for the batch re-read after a crash)."""
    if not last.end_idx:
        return rows
    return rows + [open_transaction_row(last.rows[-1], last.end_idx)]  # the reader's last row is the open one's


class ReplicationStreamReader(DataSourceStreamReader):
    """Reads whole transactions per micro-batch, spools them, and acknowledges the slot on commit."""

    def __init__(self, options: dict[str, str]) -> None:
        configure_logging()  # this runs in a Python worker of its own, whose records would go nowhere
        gc.set_threshold(*READER_GC_THRESHOLDS)  # the process is the reader's alone
        keep_heap_pages()  # each batch's strings reuse the last batch's pages
        self.options = options
        self.config_path = options["config"]
        self.database_name = options.get("database") or None
        self.spool = options.get("spool") or os.path.join(os.path.dirname(os.path.abspath(self.config_path)), "spool")
        self._reader: ChangeReader | None = None
        self._db: DatabaseConfig | None = None
        self._stream: StreamConfig | None = None
        self._config: SequinConfig | None = None
        self._store: SequinStreamSink | None = None  # its retrying connection, for the backfill pages
        self._windows = WindowTracker()
        self._last_heartbeat = 0.0
        self._initial_lsn: int | None = None
        self.slices = max(1, int(options.get("partitions") or 1))
        self.references = options.get("payload") == "spool"
        self._spooled_rows: dict[str, int] = {}
        self._last_batch_at = 0.0

    def _settings(self) -> tuple[DatabaseConfig, StreamConfig]:
        if self._db is None or self._stream is None:
            self._config = config = load_config(self.config_path)
            self._db = config.database(self.database_name)
            self._stream = config.stream
        return self._db, self._stream

    def _backfill_store(self) -> tuple[SequinStreamSink, str]:
        db, stream = self._settings()
        assert self._config is not None
        if self._store is None:
            self._store = SequinStreamSink(
                self._config.store_dsn(db.name), self._config.store.schema, stream.store_retry_timeout
            )
        return self._store, self._config.store.schema

    def _new_reader(self) -> ChangeReader:
        db, stream = self._settings()
        # A chunk of an open transaction fits in a batch, and the buffer holds one batch ahead: with
        # two (the earlier default, 400,000 rows) a 2,000,000-row transaction peaked 22 % above a
        # 200,000-row one (2,822 vs 2,315 MiB, bench/large_transaction.py), and a batch never takes more
        # than one anyway.
        return ChangeReader(
            db.dsn,
            db.slot.name,
            db.publication.name,
            buffer_rows=stream.max_batch_rows,
            buffer_bytes=stream.max_batch_bytes,
            chunk_rows=min(CHUNK_ROWS, stream.max_batch_rows),
            chunk_bytes=min(CHUNK_BYTES, stream.max_batch_bytes),
        )

    def initialOffset(self) -> dict:
        # Spark may ask more than once for a new query, and the slot may move in between (an
        # operator's pg_replication_slot_advance, a previous app's last acknowledgement): one
        # answer per reader keeps batch 0's start consistent.
        if self._initial_lsn is None:
            db, _ = self._settings()
            self._initial_lsn = confirmed_flush_lsn(db.dsn, db.slot.name)
        return {"lsn": self._initial_lsn}

    def latestOffset(self, start: dict, limit: Any) -> dict:
        db, stream = self._settings()
        position = offset_position(start)
        if self._reader is None:
            self._reader = self._new_reader()
        if not self._reader.is_open or self._reader.position != position:
            self._reader.open(position)
            self._windows.reset()  # windows opened before this position are unknown now
        self._maybe_heartbeat(db)
        try:
            result = self._reader.read(stream.max_batch_rows, stream.max_batch_bytes, stream.max_batch_wait)
        except SourceUnavailableError as exc:  # the server restarted under us: read the rest again once it is back
            log.warning("%s; reconnecting at %s", exc, position)
            self._reader.open(position)
            self._windows.reset()
            return start
        if result.end == position:
            return start
        last, rows = result, self._with_closed_windows(result.rows)
        while all(map(holdable, rows)) and time.monotonic() < self._last_batch_at + MARKS_ONLY_BATCH_INTERVAL:
            try:
                more = self._reader.read(stream.max_batch_rows, stream.max_batch_bytes, stream.max_batch_wait)
            except SourceUnavailableError:
                break  # the batch read so far stands; the next latestOffset reconnects
            if more.end != last.end:
                last, rows = more, rows + self._with_closed_windows(more.rows)
        self._last_batch_at = time.monotonic()
        # A heartbeat-only transaction gives a 0-row batch: the offset still advances, so the
        # slot is acknowledged past it and an idle database does not retain WAL.
        make_folder(self.spool)
        path = spool_path(self.spool, position, last.end)
        rows = with_open_transaction(rows, last)
        write_spool(path, rows_to_arrow(rows))
        self._spooled_rows[path] = len(rows)
        return position_offset(last.end)

    def _with_closed_windows(self, rows: list[tuple]) -> list[tuple]:
        """``rows`` and the reads of the backfill windows closed among them that go through Spark."""
        closed = self._windows.scan(rows)
        return rows + self._close_windows(closed) if closed else rows

    def _close_windows(self, closed: list[Any]) -> list[tuple]:
        """Backfill pages whose high watermark is in this batch: their reads, at its position."""
        sink, schema = self._backfill_store()
        reads: list[tuple] = []
        for window in closed:
            mark = window.mark
            emitted = sink.retrying(
                lambda conn, w=window: store.close_backfill_window(
                    conn, schema, w.mark.page_id, w.seen, set(w.changed), w.row[0]
                )
            )
            if emitted is None:
                log.info(
                    "backfill %d page %d: window %s; the page will be read again",
                    mark.backfill_id,
                    mark.page_id,
                    "seen whole, but the page is not waiting or follows one not released"
                    if window.seen
                    else "not seen by this process",
                )
                continue
            reads += read_rows(
                window.row, mark.table_schema, mark.table_name, emitted.backfill_id, emitted.sink, emitted.rows
            )
            log.info(
                "backfill %d page %d: %d reads %s (%d keys changed in its window)",
                mark.backfill_id,
                mark.page_id,
                len(emitted.rows) or emitted.in_store,
                "released (written by the task)" if emitted.in_store else "at the high watermark",
                len(window.changed),
            )
        return reads

    def _maybe_heartbeat(self, db: DatabaseConfig) -> None:
        if db.heartbeat_interval <= 0 or self._reader is None:
            return
        now = time.monotonic()
        if now - self._last_heartbeat < db.heartbeat_interval:
            return
        self._last_heartbeat = now
        try:
            self._reader.heartbeat()
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat must not stop the stream
            log.warning("heartbeat failed: %s", exc)

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        """One partition per core for large batches (collected in order, so row order holds)."""
        lo, hi = offset_position(start), offset_position(end)
        path = spool_path(self.spool, lo, hi)
        rows = self._spooled_rows.get(path, 0)
        if self.slices == 1 or rows < MIN_ROWS_PER_SLICE * 2:
            return [SpoolPartition(lo, hi, path, self.options)]
        size = -(-rows // self.slices)
        return [SpoolPartition(lo, hi, path, self.options, offset, size) for offset in range(0, rows, size)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SpoolPartition)
        freeze_long_lived()  # this runs in a reused Python worker (worker_heap)
        if partition.start == partition.end:
            # Spark runs batch 0 over (initial, initial) when the first read found nothing.
            return
        try:
            table = spool_table(partition.path).slice(partition.offset, partition.length)
        except (OSError, pa.ArrowInvalid) as exc:
            # Gone or cut short (another machine, a wiped folder, an OS crash before the data hit
            # the disk): re-read the range from the slot, deterministically from the offsets.
            log.warning("spool file %s unusable (%s): re-reading the range from the slot", partition.path, exc)
        else:
            yield from (
                spool_slice(partition.path, partition.offset, table.num_rows) if self.references else table.to_batches()
            )
            return
        replay = ReplicationStreamReader(partition.options)
        batches = list(replay.reread_from_slot(position_offset(partition.start), position_offset(partition.end)))
        whole = pa.Table.from_batches(batches, CHANGE_ARROW_SCHEMA)
        if self.references:  # the executors' writers take the rows from the file: put it back
            make_folder(partition.path.rpartition("/")[0] or ".")
            write_spool(partition.path, whole.combine_chunks().to_batches()[0] if whole.num_rows else rows_to_arrow([]))
        # the re-read is deterministic, so each slice takes its own rows of it
        table = whole.slice(partition.offset, partition.length)
        yield from (
            spool_slice(partition.path, partition.offset, table.num_rows) if self.references else table.to_batches()
        )

    def reread_from_slot(self, start: dict, end: dict) -> Iterator[pa.RecordBatch]:
        """Re-read exactly ``(start, end]`` from the slot with a reader of its own."""
        if offset_position(start) == offset_position(end):
            return iter([])
        reader = self._new_reader()
        try:
            reader.open(offset_position(start))
            result = reader.read(0, 0, 0, stop_at=offset_position(end))
        finally:
            reader.close()
        return iter([rows_to_arrow(with_open_transaction(result.rows + self._reread_windows(result.rows), result))])

    def _reread_windows(self, rows: list[tuple]) -> list[tuple]:
        """The reads a batch carried, rebuilt from the store for its high watermarks (``closing`` pages)."""
        highs = [r for r in rows if r[6] == "message" and r[5] == HIGH_PREFIX]
        if not highs:
            return []
        sink, schema = self._backfill_store()
        windows = sink.retrying(lambda conn: store.closing_windows(conn, schema, sorted({r[0] for r in highs})))
        reads: list[tuple] = []
        for row in highs:
            mark = parse_watermark(row[7])
            emitted = windows.get(mark.page_id) if mark else None
            if mark is not None and emitted is not None:
                reads += read_rows(
                    row, mark.table_schema, mark.table_name, emitted.backfill_id, emitted.sink, emitted.rows
                )
        return reads

    def commit(self, end: dict) -> None:
        position = offset_position(end)
        lsn = position[0]  # a batch may end inside a transaction: the slot moves to commit boundaries only
        if self._reader is None:
            self._reader = self._new_reader()
        self._spooled_rows = {
            p: n for p, n in self._spooled_rows.items() if spooled_end(p.rpartition("/")[2]) > position
        }
        if self._reader.is_open:
            self._reader.acknowledge(lsn)
        else:
            # After a restart Spark commits the last finished batch before it replays an
            # unfinished one, which may need the slot: acknowledge and let go of it.
            self._reader.open(lsn)
            try:
                self._reader.acknowledge(lsn)
            finally:
                self._reader.close()
        remove_spooled(self.spool, position)
        try:  # the batch is delivered: pages closed in it are emitted (a later commit retries)
            sink, schema = self._backfill_store()
            sink.retrying(lambda conn: store.finish_emitted_pages(conn, schema, lsn))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not mark delivered backfill pages emitted yet: %s", exc)
        try:  # no replay brings back a message below lsn now: its ack needs no record (a later commit retries)
            sink, schema = self._backfill_store()
            streams = self._stream_sinks()
            if streams:
                sink.retrying(lambda conn: store.prune_acked(conn, schema, streams, lsn))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not prune the acked ledger yet: %s", exc)

    def _stream_sinks(self) -> list[str]:
        """This database's Sequin Stream sinks (whose acked positions ``commit`` prunes)."""
        db, _ = self._settings()
        assert self._config is not None
        return [s.name for s in self._config.sinks_of(db.name) if s.destination.kind.stored]

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._store is not None:
            self._store.close()
