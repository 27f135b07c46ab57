"""The micro-batch pipeline (``foreachBatch``): select, filter, group, render and write to the sinks.

One Spark job per micro-batch: the JVM evaluates every sink's selection, group id and message
rendering, down to the finished COPY text line of each stream row, and each partition's task
writes its rows to the store in one COPY from the executor (``mapInArrow``), so partitions
render and write in parallel and nothing is collected on the driver. No Python runs per message
except a sink's own ``module:function`` transform. Push (webhook) sinks get one more job each:
the batch repartitioned by group and sorted by position, each task sending its groups in order
and parking what fails (DESIGN §9). The batch completes, and the slot may advance, only after
every partition has written, delivered or parked.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import psycopg
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sequin_provider import store
from sequin_provider.config import ConfigError, SequinConfig, SinkConfig, load_config
from sequin_provider.buffer import FOLLOWER_ERROR, ParkRow, backoff_seconds, park, parked_groups
from sequin_provider.delivery import (
    Outgoing,
    Transform,
    TransformError,
    apply_transform,
    group_expression,
    load_transform,
    message_expression,
    needs_parsed_record,
    push_in_group_order,
    selection_predicate,
)
from sequin_provider.messages import CHANGE_FIELD_NAMES, CHANGE_SCHEMA_DDL, idempotency_key, idempotency_key_sql
from sequin_provider.sinks.sequin_stream import SequinStreamSink
from sequin_provider.sinks.webhook import WebhookClient

log = logging.getLogger(__name__)

RECORD_MAP = "map<string,string>"
JSON_COLUMNS = ("record", "changes")


def _copy_text(column: Column) -> Column:
    """``store.copy_text`` as a Spark expression."""
    for raw, escaped in store.COPY_TEXT_ESCAPES:
        column = F.replace(column, F.lit(raw), F.lit(escaped))
    return column


def project_batch(df: DataFrame, sinks: tuple[SinkConfig, ...], database_name: str) -> DataFrame:
    """Per sink ``i``: ``_line_i``, the finished COPY line of its stream row (null when the sink
    does not take the change); for sinks with a Python transform ``_group_i``/``_data_i`` instead."""
    others = [c for c in CHANGE_FIELD_NAMES if c not in JSON_COLUMNS]
    columns: list[Column] = [F.col(c) for c in others]
    columns += [F.col(c).alias(f"{c}_json") for c in JSON_COLUMNS]
    if any(needs_parsed_record(s) for s in sinks):
        columns += [F.from_json(c, RECORD_MAP).alias(c) for c in JSON_COLUMNS]
    df = df.select(*columns)
    key = F.expr(idempotency_key_sql())
    out: list[Column] = [F.col("commit_lsn"), F.col("commit_idx")]
    if any(_python_path(s) for s in sinks):  # the Python path builds the key itself
        out += [F.col("backfill_id"), F.col("record_pks")]
    for i, sink in enumerate(sinks):
        selected = F.expr(selection_predicate(sink))
        group = F.expr(group_expression(sink))
        data = F.expr(message_expression(sink, database_name))
        if _python_path(sink):
            out += [selected.alias(f"_select_{i}"), group.alias(f"_group_{i}"), data.alias(f"_data_{i}")]
        else:
            line = F.concat_ws("\t", F.lit(sink.name), F.col("commit_lsn"), F.col("commit_idx"), _copy_text(group),
                               _copy_text(key), _copy_text(data))
            out.append(F.when(selected, F.concat(line, F.lit("\n"))).alias(f"_line_{i}"))
    return df.select(*out)


def _python_path(sink: SinkConfig) -> bool:
    """Whether a sink's rows are finished in Python (a transform, or a push sink) rather than as
    ready COPY lines rendered in the JVM."""
    return load_transform(sink.transform) is not None or sink.destination.type != "sequin_stream"


def _outgoing(batch: pa.RecordBatch, i: int, sink: SinkConfig, transform: Transform | None) -> list[Outgoing]:
    """The messages of sink ``i`` in an Arrow batch of ``project_batch`` rows, transformed; a
    transform that raises marks its message instead of failing the batch."""
    selected = batch.column(f"_select_{i}").to_pylist()
    lsn, idx = batch.column("commit_lsn").to_pylist(), batch.column("commit_idx").to_pylist()
    backfill, pks = batch.column("backfill_id").to_pylist(), batch.column("record_pks").to_pylist()
    groups, data = batch.column(f"_group_{i}").to_pylist(), batch.column(f"_data_{i}").to_pylist()
    out = []
    for j, keep in enumerate(selected):
        if not keep:
            continue
        key = idempotency_key(lsn[j], idx[j], backfill[j], pks[j])
        if transform is None:
            out.append(Outgoing(lsn[j], idx[j], groups[j], key, data[j]))
            continue
        try:
            out.append(Outgoing(lsn[j], idx[j], groups[j], key, apply_transform(sink, transform, data[j])))
        except TransformError as exc:
            out.append(Outgoing(lsn[j], idx[j], groups[j], key, None, data[j], str(exc)))
    return out


class StreamWriter:
    """Executor side: one COPY of a partition's stream rows, for every sink of a database."""

    def __init__(self, config_path: str, database: str) -> None:
        config = load_config(config_path)
        db = config.database(database)
        self.schema = config.store.schema
        self.sinks = config.sinks_of(db.name)
        self.transforms = [load_transform(s.transform) for s in self.sinks]
        self.sink = SequinStreamSink(config.store_dsn(db.name), config.store.schema, config.stream.store_retry_timeout)
        self.buffer = SequinStreamSink(config.store_dsn(db.name), config.store.schema, config.stream.store_retry_timeout)
        self._parked: list[ParkRow] = []

    def payload(self, batch: pa.RecordBatch) -> Iterator[bytes | memoryview]:
        """Every Sequin Stream sink's COPY lines of the rows in ``batch``. Messages whose transform
        raises, and later messages of their groups, are set aside to be parked."""
        for i, (sink, transform) in enumerate(zip(self.sinks, self.transforms)):
            if sink.destination.type != "sequin_stream":
                continue
            if transform is None:
                lines = pc.drop_null(batch.column(f"_line_{i}"))
                if len(lines):
                    joined = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, len(lines)], pa.int32()), lines), "")
                    yield memoryview(joined[0].as_buffer())
                continue
            messages = _outgoing(batch, i, sink, transform)
            groups = {m.group_id for m in messages}
            blocked = self.buffer.retrying(lambda conn, g=groups, n=sink.name: parked_groups(conn, self.schema, n, g))
            rows = []
            for m in messages:
                if m.group_id in blocked or m.transform_error is not None:
                    error = FOLLOWER_ERROR if m.group_id in blocked else str(m.transform_error)
                    self._parked.append(ParkRow(sink.name, m.commit_lsn, m.commit_idx, m.group_id, m.idempotency_key,
                                                m.data, m.source, 0 if m.group_id in blocked else 1, error,
                                                0.0 if m.group_id in blocked else backoff_seconds(1)))
                    blocked.add(m.group_id)
                else:
                    rows.append((sink.name, m.commit_lsn, m.commit_idx, m.group_id, m.idempotency_key, m.data))
            if rows:
                yield "".join(store.copy_line(r) + "\n" for r in rows).encode()

    def write(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``mapInArrow`` body: stream the partition into one COPY as its batches arrive, then
        report (rows, written, max_lsn, store seconds)."""
        stats = {"rows": 0, "max_lsn": None}

        def chunks() -> Iterator[bytes | memoryview]:
            for batch in batches:
                if not batch.num_rows:
                    continue
                stats["rows"] += batch.num_rows
                top = pc.max(batch.column("commit_lsn")).as_py()
                stats["max_lsn"] = top if stats["max_lsn"] is None else max(stats["max_lsn"], top)
                yield from self.payload(batch)

        started = time.monotonic()
        self._parked = []
        written = self.sink.write(chunks())
        if self._parked:  # durable before the batch completes (the slot may then pass them)
            parked = self._parked
            self.buffer.retrying(lambda conn: park(conn, self.schema, parked))
            log.warning("%d messages parked in the buffer (a transform raised): %s", len(parked), parked[0].error)
        seconds = time.monotonic() - started
        yield pa.RecordBatch.from_pydict({"rows": [stats["rows"]], "written": [written], "max_lsn": [stats["max_lsn"]],
                                          "store_seconds": [seconds]}, schema=WRITE_RESULT_SCHEMA)


class PushWriter:
    """Executor side: one partition's messages of a push (webhook) sink, sent in order per group."""

    def __init__(self, config_path: str, database: str, sink_name: str) -> None:
        config = load_config(config_path)
        self.schema = config.store.schema
        self.sink_config = next(s for s in config.sinks_of(database) if s.name == sink_name)
        self.index = config.sinks_of(database).index(self.sink_config)
        self.transform = load_transform(self.sink_config.transform)
        self.client = WebhookClient(self.sink_config)
        self.lanes = int(self.sink_config.destination.options.get("concurrency", 8))
        self.store = SequinStreamSink(config.store_dsn(database), config.store.schema, config.stream.store_retry_timeout)

    def write(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``mapInArrow`` body: deliver or park every message, then report (rows, delivered, parked, max_lsn)."""
        started = time.monotonic()
        messages: list[Outgoing] = []
        for batch in batches:
            if batch.num_rows:
                messages.extend(_outgoing(batch, self.index, self.sink_config, self.transform))
        delivered = parked_count = 0
        top = max((m.commit_lsn for m in messages), default=None)
        if messages:
            name = self.sink_config.name
            groups = {m.group_id for m in messages}
            blocked = self.store.retrying(lambda conn: parked_groups(conn, self.schema, name, groups))
            result = push_in_group_order(name, messages, self.client.send, self.client.batch_size, self.lanes, blocked)
            if result.parked:
                self.store.retrying(lambda conn: park(conn, self.schema, result.parked))
                log.warning("sink %s: %d messages parked in the buffer, first error: %s", name, len(result.parked),
                            result.parked[0].error)
            delivered, parked_count = result.delivered, len(result.parked)
        yield pa.RecordBatch.from_pydict({"rows": [len(messages)], "written": [delivered], "max_lsn": [top],
                                          "store_seconds": [time.monotonic() - started], "parked": [parked_count]},
                                         schema=PUSH_RESULT_SCHEMA)


WRITE_RESULT_SCHEMA = pa.schema([("rows", pa.int64()), ("written", pa.int64()), ("max_lsn", pa.int64()),
                                 ("store_seconds", pa.float64())])
WRITE_RESULT_DDL = "rows bigint, written bigint, max_lsn bigint, store_seconds double"
PUSH_RESULT_SCHEMA = WRITE_RESULT_SCHEMA.append(pa.field("parked", pa.int64()))
PUSH_RESULT_DDL = WRITE_RESULT_DDL + ", parked bigint"
_WRITERS: dict[tuple[str, str], StreamWriter] = {}
_PUSHERS: dict[tuple[str, str, str], PushWriter] = {}


def push_partitions(config_path: str, database: str, sink: str) -> Callable[[Iterator[pa.RecordBatch]],
                                                                              Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of a push sink: a writer per Python worker process."""

    def push(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        key = (config_path, database, sink)
        if key not in _PUSHERS:
            _PUSHERS[key] = PushWriter(config_path, database, sink)
        return _PUSHERS[key].write(batches)

    return push


def write_partitions(config_path: str, database: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: a writer per Python worker process, kept across micro-batches."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        key = (config_path, database)
        if key not in _WRITERS:
            _WRITERS[key] = StreamWriter(config_path, database)
        return _WRITERS[key].write(batches)

    return write


class Pipeline:
    """Per-database delivery: every sink of ``database`` is served from one change stream."""

    def __init__(self, config: SequinConfig, database: str) -> None:
        self.config = config
        self.database = config.database(database)
        self.sinks: tuple[SinkConfig, ...] = config.sinks_of(self.database.name)
        self._write = write_partitions(config.source, self.database.name)
        self._visibility = SequinStreamSink(config.store_dsn(self.database.name), config.store.schema,
                                            config.stream.store_retry_timeout)
        self._status_conn: Any = None
        self.stream_sinks = [s.name for s in self.sinks if s.destination.type == "sequin_stream"]
        self.push_sinks = [(i, s) for i, s in enumerate(self.sinks) if s.destination.type != "sequin_stream"]
        self._push = {s.name: push_partitions(config.source, self.database.name, s.name) for _, s in self.push_sinks}

    def validate(self, spark: Any) -> None:
        """Analyse every sink's SQL on an empty batch, so a bad filter fails at start with its sink named."""
        empty = spark.createDataFrame([], CHANGE_SCHEMA_DDL)
        for i, sink in enumerate(self.sinks):
            try:
                project_batch(empty, (sink,), self.database.name).schema  # noqa: B018 - forces analysis
            except Exception as exc:  # noqa: BLE001 - AnalysisException / ParseException
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(self.config.source, f"sinks[{i}].filter", f"invalid SQL: {first}") from None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """``foreachBatch`` entry point."""
        started = time.monotonic()
        projected = project_batch(df, self.sinks, self.database.name)
        if self.push_sinks:
            projected = projected.persist()  # rendered once, read by the stream job and each push job
        try:
            results = projected.mapInArrow(self._write, WRITE_RESULT_DDL).toArrow()
            pushed = [self._push_sink(projected, i, sink) for i, sink in self.push_sinks]
        finally:
            if self.push_sinks:
                projected.unpersist()
        rows_in = pc.sum(results.column("rows")).as_py() or 0
        written = pc.sum(results.column("written")).as_py() or 0
        end_lsn = pc.max(results.column("max_lsn")).as_py()
        store_seconds = pc.sum(results.column("store_seconds")).as_py() or 0.0
        for name, delivered, parked in pushed:
            if delivered or parked:
                log.info("batch %d: sink %s delivered %d, parked %d", batch_id, name, delivered, parked)
        if end_lsn is not None:  # every partition has committed (or delivered, or parked): the batch is done
            self._visibility.make_visible(self.stream_sinks, end_lsn)
            # and backfill pages whose reads it carried are emitted (Spark commits the source's
            # offset only when the next batch starts, which may be a heartbeat later)
            schema = self.config.store.schema
            self._visibility.retrying(lambda conn: store.finish_emitted_pages(conn, schema, end_lsn + 1))
        elapsed = time.monotonic() - started
        self._record_status(batch_id, rows_in, elapsed, end_lsn)
        if rows_in:
            log.info("batch %d: %d changes -> %d new messages in %.3fs (store COPY %.3fs summed over %d partitions,"
                     " streamed while rendering)",
                     batch_id, rows_in, written, elapsed, store_seconds, results.num_rows)

    def _push_sink(self, projected: DataFrame, i: int, sink: SinkConfig) -> tuple[str, int, int]:
        """Deliver a push sink's messages of the batch: partitioned by group, in position order
        within each partition, so a group is sent in order by one task. Returns (sink, delivered, parked)."""
        columns = [F.col("commit_lsn"), F.col("commit_idx"), F.col("backfill_id"), F.col("record_pks"),
                   F.col(f"_select_{i}"), F.col(f"_group_{i}"), F.col(f"_data_{i}")]
        partitions = max(2, int(projected.sparkSession.sparkContext.defaultParallelism))
        out = (projected.where(F.col(f"_select_{i}")).select(*columns)
               .repartition(partitions, F.col(f"_group_{i}")).sortWithinPartitions("commit_lsn", "commit_idx")
               .mapInArrow(self._push[sink.name], PUSH_RESULT_DDL).toArrow())
        return sink.name, int(pc.sum(out.column("written")).as_py() or 0), int(pc.sum(out.column("parked")).as_py() or 0)

    def _record_status(self, batch_id: int, rows: int, elapsed: float, end_lsn: int | None) -> None:
        """Best effort: the status row is for operators; the data path does not depend on it."""
        now = datetime.now(timezone.utc)
        fields: dict[str, Any] = {"slot": self.database.slot.name, "heartbeat_at": now, "last_batch_id": batch_id,
                                  "last_batch_at": now}
        if rows:
            fields.update(batch_rows=rows, batch_latency_ms=elapsed * 1000.0,
                          rows_per_sec=rows / elapsed if elapsed > 0 else None, last_commit_lsn=end_lsn)
        try:
            if self._status_conn is None or self._status_conn.closed:
                self._status_conn = psycopg.connect(self.config.store_dsn(self.database.name), connect_timeout=5)
            store.update_status(self._status_conn, self.config.store.schema, self.database.name, add_rows=rows,
                                **fields)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not record stream status: %s", exc)
            if self._status_conn is not None:
                self._status_conn.close()
            self._status_conn = None

    def close(self) -> None:
        """Release the driver's store connections (executors' writers go with their processes)."""
        self._visibility.close()
        if self._status_conn is not None:
            self._status_conn.close()
