"""The micro-batch pipeline (``foreachBatch``): select, filter, group, render and write to the sinks.

One Spark job per micro-batch: the JVM evaluates every sink's selection and filter (and group
ids where they need the record's values or a repartition), and each partition's task renders its
sinks' messages (``message_render``, vectorized over Arrow batches) and hands the stored sinks'
to their kinds' writers, one COPY per partition from the executor (``mapInArrow``; the COPY, held
groups and parking are ``sinks.stored``'s), so partitions render and write in parallel and
nothing is collected on the driver. No Python runs per message except a sink's own
``module:function`` transform. Pushed sinks (``sinks.push``; the webhook) are sent a group at a time, each group in
position order by one task, and what fails is parked (DESIGN §9): with ``payload=spool`` the
same tasks do it, each reading the batch's whole spool file and sending the groups that first
appear in its own slice (``PushWriter.write_share``); otherwise each push sink gets one more job,
the batch repartitioned by group and sorted by position. The batch completes, and the slot may
advance, only after every partition has written, delivered or parked. A batched kind's sinks
(``DestinationKind.batched``: Iceberg) are written last, on the driver: it collects each such sink's
messages of the batch (``batch_outgoing``; ``spooled_outgoing`` from the spool file of a batch the
driver writes itself, ``deliver_on_driver``) and hands them to ``kind.commit_batch`` at once, so the
kind can commit the batch as one transaction before the batch completes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from sequin_provider import store
from sequin_provider.buffer import backoff_seconds, change_source
from sequin_provider.change_arrow import open_transaction_lsn
from sequin_provider.config import ConfigError, SequinConfig, SinkConfig, load_config
from sequin_provider.delivery import (
    Outgoing,
    group_expression,
    load_transform,
    needs_parsed_record,
    selected_actions,
    selection_predicate,
)
from sequin_provider.exceptions import StoreUnavailableError
from sequin_provider.logs import configure_logging
from sequin_provider.message_render import RenderedRows, SinkRendering, outgoing, render, selection
from sequin_provider.messages import CHANGE_FIELD_NAMES, CHANGE_SCHEMA_DDL
from sequin_provider.metrics.stream import COMMIT_TIMESTAMP_PRECISION_MS, BatchReport, StreamMetrics
from sequin_provider.sinks.sequin_stream import SequinStreamSink
from sequin_provider.sinks.stored import StoredSinkWriter, StreamTableWriter
from sequin_provider.spark.arrow_map import ArrowMap
from sequin_provider.spark.driver_batch import batch_spool_file, default_driver_batch_rows
from sequin_provider.spark.poison import (
    JSON_COLUMNS,
    engine_error,
    isolate,
    key_of,
    parse_changes,
    position_key,
    without_failed,
)
from sequin_provider.spark.source import SPOOL_SLICE_DDL, spool_slice, spool_slice_rows
from sequin_provider.spark.spool import spool_table
from sequin_provider.spark.worker_heap import freeze_long_lived, tune_driver_collection
from sequin_provider.store import ParkRow, park_messages

log = logging.getLogger(__name__)

RENDER_COLUMNS = tuple(c for c in CHANGE_FIELD_NAMES if c not in ("xid", "backfill_sink"))
"""The change row's columns the executors render messages from (``record``/``changes`` as JSON text)."""
SUBEXPRESSION_ELIMINATION = "spark.sql.subexpressionElimination.enabled"
DRIVER_BATCHES_REMEMBERED = 1_000
"""Batches the driver wrote whose change counts ``Pipeline.driver_changes`` answers (Spark keeps the
progress of its last 100)."""
TEST_STALL_AFTER_STORE_ENV = "SEQUIN_TEST_STALL_AFTER_STORE"
"""Tests only: a file path, the trigger. While that file exists, the next micro-batch that writes
messages, once they are in the store and visible, renames it to ``<path>.stalled`` and freezes the
driver until the app is killed: a crash between the store commit and Spark's offset commit while
consumers receive and ack (Spark replays the batch). A test arms it by creating the file, before
the app starts or while it runs."""


def group_in_jvm(sink: SinkConfig) -> bool:
    """Whether a ``payload=full`` batch carries a sink's group ids computed by Spark: custom group
    columns need the record's values, and a push sink's batch is repartitioned by group.
    Otherwise the executor renders them."""
    return sink.destination.kind.pushed or (sink.message_grouping and any(t.group_column_names for t in sink.tables))


def payload_mode(sinks: tuple[SinkConfig, ...]) -> str:
    """The source's ``payload`` for these sinks: ``spool`` (Spark carries one row per slice of the
    spool file; the executors' writers and pushers take the change rows from there and select
    them, ``message_render.selection``) when no sink needs Spark SQL (a filter, custom group
    columns); otherwise ``full``."""
    return "full" if any(needs_parsed_record(s) for s in sinks) else "spool"


def project_batch(
    df: DataFrame, sinks: tuple[SinkConfig, ...], failed: Mapping[int, Mapping[str, str]] | None = None
) -> DataFrame:
    """The change columns messages are rendered from, and per sink ``i`` ``_select_i`` (whether the
    sink takes the change: tables, actions, filter) and, where Spark computes it, ``_group_i``. A
    ``payload=spool`` batch (slices of spool files) passes as it is: the writers read and select
    its rows (``with_selections``). ``failed``: per sink, the positions (``poison.key_of``) its
    filter fails on (``poison.isolate``), which it does not take and where its filter is not run."""
    if "spool_rows" in df.columns:
        if any(needs_parsed_record(s) for s in sinks):
            raise ValueError("a payload=spool batch carries no record values for these sinks' SQL")
        return df
    df = parse_changes(df, parse=any(needs_parsed_record(s) for s in sinks))
    out: list[Column] = [F.col(f"{c}_json").alias(c) if c in JSON_COLUMNS else F.col(c) for c in RENDER_COLUMNS]
    for i, sink in enumerate(sinks):
        selected = F.coalesce(F.expr(selection_predicate(sink)), F.lit(False))
        out.append(without_failed(selected, (failed or {}).get(i)).alias(f"_select_{i}"))
        if group_in_jvm(sink):
            out.append(F.expr(group_expression(sink)).alias(f"_group_{i}"))
    return df.select(*out)


def with_selections(changes: pa.RecordBatch, renderings: list[SinkRendering]) -> pa.RecordBatch:
    """Change rows of a ``payload=spool`` slice with each sink's ``_select_i``
    (``message_render.selection``, where Spark SQL would have computed it), less the rows no sink takes."""
    flags = [selection(changes, r) for r in renderings]
    selected = pa.RecordBatch.from_arrays(
        changes.columns + flags, names=changes.schema.names + [f"_select_{i}" for i in range(len(flags))]
    )
    wanted = flags[0] if flags else pa.array([False] * changes.num_rows)
    for flag in flags[1:]:
        wanted = pc.or_(wanted, flag)
    return selected if pc.all(wanted).as_py() else selected.filter(wanted)


def _rendered(batch: pa.RecordBatch, i: int, rendering: SinkRendering, compact: bool = False) -> RenderedRows:
    """Sink ``i``'s stream rows of a batch of ``project_batch`` rows (``compact``: for the store,
    ``message_render.render``)."""
    selected = batch.filter(batch.column(f"_select_{i}"))
    group = selected.column(f"_group_{i}") if f"_group_{i}" in selected.schema.names else None
    return render(selected, rendering, group, compact=compact)


class CommitTimes:
    """A task's commit timestamps for the commit-to-durable histogram: how many changes committed in
    each ``COMMIT_TIMESTAMP_PRECISION_MS`` (value counts of the truncated ISO text, then parsed once per
    distinct value), so the report is one entry per 10 ms of commits however many changes they hold."""

    TEXT_LENGTH = len("2026-01-01T00:00:00.00")  # ``pgoutput.pg_timestamp_to_iso`` cut to 10 ms
    PATTERN = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d\d$"

    def __init__(self) -> None:
        self.parts: list[pa.StructArray] = []

    def add(self, changes: pa.RecordBatch) -> None:
        """Count the commit times of a batch of change rows."""
        cut = pc.utf8_slice_codeunits(changes.column("commit_timestamp"), 0, self.TEXT_LENGTH)
        self.parts.append(pc.value_counts(cut))

    def report(self) -> tuple[list[int], list[int]]:
        """(epoch milliseconds, changes) per distinct 10 ms; what cannot be parsed is left out."""
        if not self.parts:
            return [], []
        table = (
            pa.Table.from_arrays(
                [
                    pa.concat_arrays([p.field("values") for p in self.parts]),
                    pa.concat_arrays([p.field("counts") for p in self.parts]),
                ],
                names=["at", "n"],
            )
            .group_by("at")
            .aggregate([("n", "sum")])
        )
        table = table.filter(pc.match_substring_regex(table.column("at"), self.PATTERN))  # another format: left out
        millis = pc.cast(pc.cast(table.column("at"), pa.timestamp("ms")), pa.int64())
        return millis.to_pylist(), table.column("n_sum").to_pylist()


assert COMMIT_TIMESTAMP_PRECISION_MS == 10, "CommitTimes.TEXT_LENGTH cuts the text to 10 ms"


class StreamWriter:
    """Executor side: one COPY of a partition's stream rows, for every stored sink of a database
    (``sinks.stored.StreamTableWriter``, each sink's share made by its kind); with
    ``payload=spool``, also the push sinks' share of the batch that falls to this partition, over
    ``lane_factor`` times each sink's lanes (``PushWriter``)."""

    def __init__(self, config_path: str, database: str, lane_factor: int = 1) -> None:
        config = load_config(config_path)
        db = config.database(database)
        self.config_path, self.database, self.lane_factor = config_path, db.name, lane_factor
        self.sinks = config.sinks_of(db.name)
        self.copies = any(s.destination.kind.stored for s in self.sinks)
        self.pushes = any(s.destination.kind.pushed and "truncate" in selected_actions(s) for s in self.sinks)
        self.renderings = [SinkRendering.of(s, db.name) for s in self.sinks]
        self.table = StreamTableWriter(
            [s for s in self.sinks if s.destination.kind.stored],
            config.store.schema,
            SequinStreamSink(config.store_dsn(db.name), config.store.schema, config.stream.store_retry_timeout),
            SequinStreamSink(config.store_dsn(db.name), config.store.schema, config.stream.store_retry_timeout),
        )
        self.stored: list[tuple[int, SinkRendering, StoredSinkWriter]] = [
            (i, self.renderings[i], self.table.writer(s.name))
            for i, s in enumerate(self.sinks)
            if s.destination.kind.stored
        ]
        """Per stored sink: its index in the projected batch (``_select_i``), rendering and writer."""

    def close(self) -> None:
        """Release the store connections (a worker's writer lives as long as its process; the driver's, its app)."""
        self.table.store.close()
        self.table.buffer.close()

    def payload(self, batch: pa.RecordBatch) -> Iterator[bytes | memoryview]:
        """Every stored sink's COPY binary tuples of the rows in ``batch`` (``StoredSinkWriter.tuples``:
        messages of a failed transform, and those behind parked groups, are set aside to be parked)."""
        for i, rendering, writer in self.stored:
            yield from writer.tuples(_rendered(batch, i, rendering, writer.compact))

    def write(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``mapInArrow`` body: stream the partition into one COPY as its batches arrive, then send
        the push sinks' share of a spooled batch, and report (rows, written, max_lsn, store
        seconds, delivered, parked, and per sink for the metrics)."""
        stats: dict[str, Any] = {"rows": 0, "min_lsn": None, "max_lsn": None, "open_lsn": None}
        commit_times = CommitTimes()
        slices: list[tuple[str, int, int]] = []
        truncated: set[str] = set()

        def chunks() -> Iterator[bytes | memoryview]:
            for batch in batches:
                spooled = "spool_rows" in batch.schema.names  # payload=spool: slices to read and select
                if spooled:
                    slices.extend(
                        zip(
                            batch.column("spool_path").to_pylist(),
                            batch.column("spool_offset").to_pylist(),
                            batch.column("spool_rows").to_pylist(),
                        )
                    )
                for changes in spool_slice_rows(batch) if spooled else (batch,):
                    if not changes.num_rows:
                        continue
                    stats["rows"] += changes.num_rows
                    commit_times.add(changes)
                    span = pc.min_max(changes.column("commit_lsn"))
                    bottom, top = span["min"].as_py(), span["max"].as_py()
                    stats["min_lsn"] = bottom if stats["min_lsn"] is None else min(stats["min_lsn"], bottom)
                    stats["max_lsn"] = top if stats["max_lsn"] is None else max(stats["max_lsn"], top)
                    opened = open_transaction_lsn(changes)
                    if opened is not None:
                        stats["open_lsn"] = opened
                    if not spooled and self.pushes:  # its push jobs co-locate a truncated table (Pipeline._push_sink)
                        truncated.update(truncated_tables(changes))
                    if self.copies:  # push sinks of a spooled batch are sent after the COPY (write_share)
                        yield from self.payload(with_selections(changes, self.renderings) if spooled else changes)

        started = time.monotonic()
        if self.copies:  # the COPY, then what was set aside parked: durable before the batch completes
            written = self.table.write(
                chunks(), span=lambda: None if stats["min_lsn"] is None else (stats["min_lsn"], stats["max_lsn"])
            )  # the acked positions to skip
        else:  # only push sinks: the slices are read for the counts, nothing is copied
            written = 0
            for _ in chunks():
                pass
        seconds = time.monotonic() - started
        delivered = pushed_parked = 0
        copied, set_aside = (self.table.counts, self.table.parked_counts()) if self.copies else ({}, {})
        sink_delivered = [copied.get(s.name, 0) for s in self.sinks]
        sink_parked = [set_aside.get(s.name, 0) for s in self.sinks]
        for i, sink in enumerate(self.sinks) if slices else ():
            if sink.destination.kind.pushed:
                pusher = push_writer(self.config_path, self.database, sink.name, self.lane_factor)
                sent, held = pusher.write_share(slices)
                delivered, pushed_parked = delivered + sent, pushed_parked + held
                sink_delivered[i] += sent
                sink_parked[i] += held
        commit_ms, commit_counts = commit_times.report()
        yield pa.RecordBatch.from_pydict(
            {
                "rows": [stats["rows"]],
                "written": [written],
                "max_lsn": [stats["max_lsn"]],
                "store_seconds": [seconds],
                "delivered": [delivered],
                "parked": [pushed_parked],
                "open_lsn": [stats["open_lsn"]],
                "truncated": [sorted(truncated)],
                "sink_delivered": [sink_delivered],
                "sink_parked": [sink_parked],
                "commit_ms": [commit_ms],
                "commit_counts": [commit_counts],
            },
            schema=WRITE_RESULT_SCHEMA,
        )


def batch_outgoing(projected: DataFrame, i: int, sink: SinkConfig, database: str) -> Outgoing:
    """Sink ``i``'s messages of a projected batch (``project_batch``), collected on the driver,
    rendered and transformed as a push sink's (``message_render.outgoing``), in position order:
    a ``payload=spool`` batch's slices are read from its spool file (``spooled_outgoing``), a
    ``payload=full`` batch's selected rows are collected."""
    if "spool_rows" in projected.columns:
        return spooled_outgoing(projected.toArrow().to_batches(), sink, database)
    wanted = [*RENDER_COLUMNS, f"_select_{i}"] + ([f"_group_{i}"] if f"_group_{i}" in projected.columns else [])
    parts = projected.where(F.col(f"_select_{i}")).select(*wanted).toArrow().to_batches()
    return _outgoing_in_order(parts, i, SinkRendering.of(sink, database), sink)


def spooled_outgoing(slices: Iterable[pa.RecordBatch], sink: SinkConfig, database: str) -> Outgoing:
    """A sink's messages of the spool slices ``slices`` (``payload=spool`` rows) in position order,
    selected here for the sink (``with_selections``), rendered and transformed as in ``batch_outgoing``."""
    rendering = SinkRendering.of(sink, database)
    parts = [with_selections(changes, [rendering]) for batch in slices for changes in spool_slice_rows(batch)]
    return _outgoing_in_order(parts, 0, rendering, sink)  # the one rendering's ``_select_0``


def _outgoing_in_order(
    parts: list[pa.RecordBatch], column: int, rendering: SinkRendering, sink: SinkConfig
) -> Outgoing:
    """The selected rows of ``parts`` (``_select_<column>``) sorted by position, as ``Outgoing``."""
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return Outgoing()
    table = pa.Table.from_batches(parts).sort_by([("commit_lsn", "ascending"), ("commit_idx", "ascending")])
    batch = table.combine_chunks().to_batches()[0]
    return outgoing(_rendered(batch, column, rendering), sink, load_transform(sink.transform))


SHARE_KEY_COLUMNS = ["commit_lsn", "commit_idx", "table_schema", "table_name", "record_pks"]
"""The change columns that give a message's position and its share key (``share_keys``)."""


def share_keys(changes: pa.RecordBatch) -> pa.Array:
    """A key per change that is equal for changes of one default group (table and primary key):
    the tasks share out whole groups by it. Cheaper than the group ids themselves (no JSON); keys
    that contain the separators may make two groups share a key, which only sends both from one task."""
    pks = pc.binary_join(changes.column("record_pks"), "\x1f")
    return pc.binary_join_element_wise(changes.column("table_schema"), changes.column("table_name"), pks, "\x1e")


def table_keys(changes: pa.RecordBatch | pa.Table) -> pa.Array:
    """``schema\0table`` of each change."""
    return pc.binary_join_element_wise(changes.column("table_schema"), changes.column("table_name"), "\0")


def truncated_tables(changes: pa.RecordBatch) -> list[str]:
    """The tables (``table_keys``) that ``changes`` truncate; one comparison per change when none."""
    truncate = pc.fill_null(pc.equal(changes.column("action"), "truncate"), False)
    if not pc.any(truncate).as_py():
        return []
    return pc.unique(table_keys(changes.filter(truncate))).to_pylist()


def barrier_shares(keys: pa.Table, actions: pa.Array, shares: pa.Array | None) -> pa.Array | None:
    """Share keys (``share_keys``; None: each message its own) with every change of a table that a
    change among them truncates given one share, its table: a truncate is a barrier for its table
    (``delivery.push_in_group_order``), so that table's messages must be sent by one task. For a
    sink that does not group (``shares`` None) a truncate is a barrier for every message."""
    truncate = pc.fill_null(pc.equal(actions, "truncate"), False)
    if not pc.any(truncate).as_py():
        return shares
    if shares is None:
        return pa.array(["\0"] * len(keys), pa.string())
    tables = table_keys(keys)
    barred = pc.is_in(tables, value_set=pc.unique(tables.filter(truncate)))
    return pc.if_else(barred, pc.binary_join_element_wise("\0", tables, ""), shares)


def first_of_group(groups: pa.Array) -> np.ndarray:
    """For each message (in position order), the index of its group's first message."""
    codes = pc.dictionary_encode(groups, null_encoding="encode").indices.to_numpy()
    first = np.full(int(codes.max()) + 1 if len(codes) else 0, len(codes), dtype=np.int64)
    np.minimum.at(first, codes, np.arange(len(codes)))
    return first[codes]


class PushWriter:
    """Executor side: one partition's messages of a pushed sink (``DestinationKind.pusher``), sent in
    order per group. ``lane_factor`` multiplies the sink's lanes: the driver writing a whole batch
    (``Pipeline.deliver_on_driver``) sends over as many lanes as the batch's tasks would have together."""

    def __init__(self, config_path: str, database: str, sink_name: str, lane_factor: int = 1) -> None:
        config = load_config(config_path)
        self.schema = config.store.schema
        self.sink_config = config.sink(sink_name)
        self.index = config.sinks_of(database).index(self.sink_config)
        self.sink_count = len(config.sinks_of(database))
        self.transform = load_transform(self.sink_config.transform)
        self.rendering = SinkRendering.of(self.sink_config, database)
        self.pusher = self.sink_config.destination.kind.pusher(self.sink_config)
        self.pusher.lanes *= max(1, lane_factor)
        self.store = SequinStreamSink(
            config.store_dsn(database), config.store.schema, config.stream.store_retry_timeout
        )

    def write(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``mapInArrow`` body over a ``payload=full`` partition (repartitioned by group, sorted by
        position): deliver or park every message, then report (rows, delivered, parked, max_lsn)."""
        started = time.monotonic()
        messages = Outgoing()
        for batch in batches:
            if batch.num_rows:
                messages.extend(
                    outgoing(_rendered(batch, self.index, self.rendering), self.sink_config, self.transform)
                )
        top = max(messages.commit_lsn, default=None)
        delivered, parked = self._deliver(messages)
        yield pa.RecordBatch.from_pydict(
            {
                "rows": [len(messages)],
                "written": [0],
                "max_lsn": [top],
                "store_seconds": [time.monotonic() - started],
                "delivered": [delivered],
                "parked": [parked],
                "open_lsn": [None],
                "truncated": [[]],
                **sink_report(self.sink_count, self.index, delivered, parked),
            },
            schema=WRITE_RESULT_SCHEMA,
        )

    def write_share(self, slices: list[tuple[str, int, int]]) -> tuple[int, int]:
        """Deliver or park this partition's share of a spooled batch: the sink's messages of every
        group whose first message of the batch (in position order) lies in one of ``slices``
        (spool path, offset, rows). Every partition reads the batch's whole spool file, so a group
        is sent by exactly one of them, in position order; returns (delivered, parked)."""
        messages = Outgoing()
        for path in sorted({p for p, _, _ in slices}):  # one file per batch (source.spool_path)
            whole = spool_table(path).combine_chunks()
            if not whole.num_rows:
                continue
            changes = whole.to_batches()[0]
            file_rows = pc.indices_nonzero(selection(changes, self.rendering))  # the sink's messages' rows
            if not len(file_rows):
                continue
            # Only the columns that place and group a message are gathered for the whole file; the
            # rows to send, about 1/partitions of it, are gathered whole once, at the end.
            keys = changes.select(SHARE_KEY_COLUMNS).take(file_rows)
            # in position order: a backfill's reads come at the end of the file, at their window's position
            order = pc.sort_indices(keys, [("commit_lsn", "ascending"), ("commit_idx", "ascending")])
            file_rows, keys = file_rows.take(order), keys.take(order)
            rows = file_rows.to_numpy()
            shares = barrier_shares(
                keys, changes.column("action").take(file_rows), share_keys(keys) if self.rendering.grouped else None
            )
            first = rows[first_of_group(shares)] if shares is not None else rows
            mine = np.zeros(len(first), dtype=bool)
            for _, offset, count in (s for s in slices if s[0] == path):
                mine |= (first >= offset) & (first < offset + count)
            ours = render(changes.take(file_rows.filter(mine)), self.rendering)
            messages.extend(outgoing(ours, self.sink_config, self.transform))
        return self._deliver(messages)

    def _deliver(self, messages: Outgoing) -> tuple[int, int]:
        """Send ``messages`` (position order) through the sink's pusher (``sinks.push.PushSink.deliver``:
        in order per group, failures parked); returns (delivered, parked)."""
        return self.pusher.deliver(messages, self.store, self.schema)


WRITE_RESULT_SCHEMA = pa.schema(
    [
        ("rows", pa.int64()),
        ("written", pa.int64()),
        ("max_lsn", pa.int64()),
        ("store_seconds", pa.float64()),
        ("delivered", pa.int64()),
        ("parked", pa.int64()),
        ("open_lsn", pa.int64()),
        ("truncated", pa.list_(pa.string())),
        ("sink_delivered", pa.list_(pa.int64())),
        ("sink_parked", pa.list_(pa.int64())),
        ("commit_ms", pa.list_(pa.int64())),
        ("commit_counts", pa.list_(pa.int64())),
    ]
)
WRITE_RESULT_TYPE = from_arrow_schema(WRITE_RESULT_SCHEMA)
"""A task's report: change rows read, stream rows copied, the highest position read, its seconds,
push messages delivered and parked, the commit LSN of the transaction the batch ends inside (its
marker row was in this task's rows; null otherwise), and the tables truncated in a ``payload=full``
batch that has push sinks (``truncated_tables``); for the metrics, the messages delivered and parked
per sink (indexed as ``config.sinks_of(database)``) and the commit times of the task's change rows
(``CommitTimes``: epoch milliseconds and how many; a push job's tasks report none, the stream job's
tasks read the same rows)."""


def sink_report(sinks: int, index: int, delivered: int, parked: int) -> dict[str, list[Any]]:
    """The per-sink columns of a report of one sink's job (``PushWriter.write``, a batched commit)."""
    sink_delivered, sink_parked = [0] * sinks, [0] * sinks
    sink_delivered[index], sink_parked[index] = delivered, parked
    return {"sink_delivered": [sink_delivered], "sink_parked": [sink_parked], "commit_ms": [[]], "commit_counts": [[]]}


_WRITERS: dict[tuple[str, str], StreamWriter] = {}
_PUSHERS: dict[tuple[str, str, str, int], PushWriter] = {}


def log_writer_ready(what: str) -> None:
    """Say, once per Python worker, which host and executor deliver from now on (on a cluster the
    line lands in the executor's own log: a standalone worker's ``<app>/<executor>/stderr``)."""
    configure_logging()  # a Python worker starts with no handler
    executor = os.environ.get("SPARK_EXECUTOR_ID") or executor_of_log_url(os.environ.get("SPARK_LOG_URL_STDERR", ""))
    log.info("%s is ready on %s (executor %s, pid %d)", what, socket.gethostname(), executor or "driver", os.getpid())


def executor_of_log_url(url: str) -> str | None:
    """The executor id a standalone worker puts in its executors' log URL (``…&executorId=3&…``)."""
    for part in url.partition("?")[2].split("&"):
        key, _, value = part.partition("=")
        if key == "executorId":
            return value
    return None


def stream_writer(config_path: str, database: str) -> StreamWriter:
    """This Python worker's writer of ``database`` (its config, renderings and store connection are
    made once per worker, not per task).

    A module-level function on purpose: the ``mapInArrow`` closures below are pickled by value, with
    a copy of the module globals they name, so a cache they read directly would be a new, empty
    dict in every task; this function is pickled by reference and reads the module's own cache."""
    key = (config_path, database)
    writer = _WRITERS.get(key)
    if writer is None:
        writer = _WRITERS[key] = StreamWriter(config_path, database)
        log_writer_ready(f"the stream writer of database {database!r}")
    freeze_long_lived()
    return writer


def push_writer(config_path: str, database: str, sink: str, lane_factor: int = 1) -> PushWriter:
    """This Python worker's writer of push sink ``sink`` (as ``stream_writer``)."""
    key = (config_path, database, sink, lane_factor)
    writer = _PUSHERS.get(key)
    if writer is None:
        writer = _PUSHERS[key] = PushWriter(config_path, database, sink, lane_factor)
        log_writer_ready(f"the writer of push sink {sink!r}")
    freeze_long_lived()
    return writer


def push_partitions(
    config_path: str, database: str, sink: str
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of a push sink: a writer per Python worker process."""

    def push(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return push_writer(config_path, database, sink).write(batches)

    return push


def write_partitions(config_path: str, database: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: a writer per Python worker process, kept across micro-batches."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return stream_writer(config_path, database).write(batches)

    return write


class Pipeline:
    """Per-database delivery: every sink of ``database`` is served from one change stream."""

    def __init__(self, config: SequinConfig, database: str) -> None:
        self.config = config
        self.database = config.database(database)
        self.sinks: tuple[SinkConfig, ...] = config.sinks_of(self.database.name)
        self._write = ArrowMap(write_partitions(config.source, self.database.name), WRITE_RESULT_TYPE)
        self._visibility = SequinStreamSink(
            config.store_dsn(self.database.name), config.store.schema, config.stream.store_retry_timeout
        )
        self._status_conn: Any = None
        self.stream_sinks = [s.name for s in self.sinks if s.destination.kind.stored]
        self.push_sinks = [(i, s) for i, s in enumerate(self.sinks) if s.destination.kind.pushed]
        self._push = {
            s.name: ArrowMap(push_partitions(config.source, self.database.name, s.name), WRITE_RESULT_TYPE)
            for _, s in self.push_sinks
        }
        self.batch_sinks = [(i, s) for i, s in enumerate(self.sinks) if s.destination.kind.batched]
        """Sinks whose kind takes each micro-batch's messages at once on the driver (``DestinationKind.commit_batch``)."""
        self.payload = payload_mode(self.sinks)
        self.metrics = StreamMetrics(config, self.database.name)
        """Fed by every finished micro-batch (``record_metrics``); ``run_stream_app`` serves it."""
        self._test_stall = os.environ.get(TEST_STALL_AFTER_STORE_ENV) or None  # read once: free when unset
        self._batch_files: tuple[str, str] | None = None
        """(checkpoint, spool) once ``write_small_batches`` is called: the driver writes small batches."""
        self.driver_batch_rows = 0
        """The most changes of a batch the driver writes (``write_small_batches``); 0: none."""
        self.driver_lane_factor = 1
        """The tasks a batch's job runs (``write_small_batches``): the driver's push lanes are that many
        times a sink's ``concurrency``, as many as the job's tasks send over together."""
        self._driver_writer: StreamWriter | None = None
        self._driver_written: dict[int, int] = {}
        """Changes of the recent batches the driver wrote, by batch id (``driver_changes``)."""

    def write_small_batches(self, checkpoint: str, spool: str, local_master: bool, tasks: int = 1) -> None:
        """Have the driver write a ``payload=spool`` batch of at most ``stream.driver_batch_rows``
        changes itself, from its spool file (``driver_batch.batch_spool_file``), instead of running a
        Spark job for it: the same writer as a task's (``StreamWriter``), without the job's scheduling,
        Python workers and report, which cost a small batch most of its time, and under load on a
        local master more than its parallel tasks gain. Unset, the limit is
        ``driver_batch.default_driver_batch_rows``: every batch on a local master, 0 on a cluster
        (whose driver may not reach the sinks the executors do). ``tasks`` is how many tasks the
        batch's job would run (the source's partitions): the driver sends each push sink's messages
        over that many times its ``concurrency`` lanes, as the job's tasks would together, and hands
        each batched sink (``batch_sinks``) the batch's messages read from the same spool file."""
        configured = self.config.stream.driver_batch_rows
        limit = (
            configured
            if configured is not None
            else default_driver_batch_rows(local_master, self.config.stream.max_batch_rows)
        )
        if self.payload == "spool" and limit > 0:
            self._batch_files = (checkpoint, spool)
            self.driver_batch_rows = limit
            self.driver_lane_factor = max(1, tasks)

    def validate(self, spark: Any) -> None:
        """Analyse every sink's SQL on an empty batch, so a bad filter fails at start with its sink named."""
        empty = spark.createDataFrame([], SPOOL_SLICE_DDL if self.payload == "spool" else CHANGE_SCHEMA_DDL)
        for i, sink in enumerate(self.sinks):
            try:
                project_batch(empty, (sink,)).schema  # noqa: B018 - forces analysis
            except Exception as exc:  # noqa: BLE001 - AnalysisException / ParseException
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(self.config.source, f"sinks[{i}].filter", f"invalid SQL: {first}") from None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """``foreachBatch`` entry point."""
        tune_driver_collection()
        started = time.monotonic()
        on_driver = self.deliver_on_driver(batch_id)
        if on_driver is not None:
            results, pushed = on_driver
        else:
            try:
                results, pushed = self._deliver(project_batch(df, self.sinks))
            except Exception as exc:  # noqa: BLE001 - a filter failing on some rows, or a failure of the batch
                results, pushed = self._deliver_around_poison(df, batch_id, exc)
        rows_in = pc.sum(results.column("rows")).as_py() or 0
        written = pc.sum(results.column("written")).as_py() or 0
        end_lsn = pc.max(results.column("max_lsn")).as_py()
        opened = pc.min(results.column("open_lsn")).as_py()
        if opened is not None and end_lsn is not None:
            # The batch ends inside a transaction: its messages so far stay invisible until the batch
            # that completes it, since a later batch's partitions commit the rest one by one (a
            # consumer must never get a group's later message before an earlier one is written).
            end_lsn = opened - 1
        store_seconds = pc.sum(results.column("store_seconds")).as_py() or 0.0
        delivered = sum(pc.sum(r.column("delivered")).as_py() or 0 for r in [results, *pushed])
        parked = sum(pc.sum(r.column("parked")).as_py() or 0 for r in [results, *pushed])
        if delivered or parked:
            log.info(
                "batch %d: push sinks %s delivered %d, parked %d",
                batch_id,
                ", ".join(s.name for _, s in [*self.push_sinks, *self.batch_sinks]),
                delivered,
                parked,
            )
        if end_lsn is not None:  # every partition has committed (or delivered, or parked): the batch is done
            self._visibility.make_visible(self.stream_sinks, end_lsn)
            # and backfill pages whose reads it carried are emitted (Spark commits the source's
            # offset only when the next batch starts, which may be a heartbeat later)
            schema = self.config.store.schema
            self._visibility.retrying(lambda conn: store.finish_emitted_pages(conn, schema, end_lsn + 1))
            if self._test_stall is not None and written and os.path.exists(self._test_stall):
                self._stall_for_test(self._test_stall)
        elapsed = time.monotonic() - started
        self._record_status(batch_id, rows_in, elapsed, end_lsn)
        self.record_metrics([results, *pushed], rows_in, elapsed)
        if rows_in and on_driver is not None:
            self._driver_written[batch_id] = rows_in
            while len(self._driver_written) > DRIVER_BATCHES_REMEMBERED:
                del self._driver_written[next(iter(self._driver_written))]
            log.info(
                "batch %d: %d changes -> %d new messages in %.3fs, written by the driver (store COPY %.3fs)",
                batch_id,
                rows_in,
                written,
                elapsed,
                store_seconds,
            )
        elif rows_in:
            log.info(
                "batch %d: %d changes -> %d new messages in %.3fs (store COPY %.3fs summed over %d partitions,"
                " streamed while rendering)",
                batch_id,
                rows_in,
                written,
                elapsed,
                store_seconds,
                results.num_rows,
            )

    def record_metrics(self, reports: list[pa.Table], rows: int, elapsed: float) -> None:
        """Add a finished micro-batch's task reports to ``metrics`` (never fails the batch)."""
        try:
            delivered, parked = np.zeros(len(self.sinks), np.int64), np.zeros(len(self.sinks), np.int64)
            for report in reports:
                for column, total in (("sink_delivered", delivered), ("sink_parked", parked)):
                    for values in report.column(column).to_pylist():
                        if values:
                            total += np.asarray(values, np.int64)
            results = reports[0]
            self.metrics.record_batch(
                BatchReport(
                    rows,
                    elapsed,
                    delivered.tolist(),
                    parked.tolist(),
                    pc.list_flatten(results.column("commit_ms")).to_numpy(zero_copy_only=False),
                    pc.list_flatten(results.column("commit_counts")).to_numpy(zero_copy_only=False),
                    time.time() * 1000.0,
                )
            )
        except Exception as exc:  # noqa: BLE001 - metrics are for operators; the data path does not depend on them
            log.warning("could not record the batch's metrics: %s", exc)

    @staticmethod
    def _stall_for_test(trigger: str) -> None:
        """``TEST_STALL_AFTER_STORE_ENV``: take the trigger (``<trigger>.stalled`` says so), then never return."""
        log.warning("test stall: batch stored and visible, its offset not committed; waiting to be killed")
        os.replace(trigger, f"{trigger}.stalled")
        threading.Event().wait()

    def driver_changes(self, batch_id: int) -> int:
        """How many changes the driver wrote in micro-batch ``batch_id`` (0: none, or the job wrote
        them, or too long ago): Spark's progress counts no input rows for such a batch."""
        return self._driver_written.get(batch_id, 0)

    def deliver_on_driver(self, batch_id: int) -> tuple[pa.Table, list[pa.Table]] | None:
        """Write a small spooled batch here (``write_small_batches``): the report a task would make
        and, for each batched sink, its commit's (``_commit_batch``, from the spool file as its job
        would read it), or None to run the batch's Spark job instead (no spool file found or readable,
        too many rows, or a failure while writing other than the store's outage, which fails the batch
        as the job's would). The job writes the batch again at the same positions, so the store
        ignores what the driver wrote before it failed; a push sink may get some messages twice (at
        least once). A batched sink's commit is not retried by the job: its failure fails the batch,
        as in the job's way (``DestinationKind.commit_batch``)."""
        try:
            path = batch_spool_file(*self._batch_files, batch_id) if self._batch_files is not None else None
            rows = spool_table(path).num_rows if path is not None else None
        except Exception as exc:  # noqa: BLE001 - nothing written yet: the job reads the batch, or the slot
            log.warning("batch %d: the driver cannot read its spool file (%s); running its Spark job", batch_id, exc)
            return None
        if path is None or rows is None or rows > self.driver_batch_rows:
            return None
        if self._driver_writer is None:
            self._driver_writer = StreamWriter(self.config.source, self.database.name, self.driver_lane_factor)
        try:
            results = pa.Table.from_batches(
                list(self._driver_writer.write(spool_slice(path, 0, rows))), WRITE_RESULT_SCHEMA
            )
        except StoreUnavailableError:
            raise  # the job would wait out the same outage again before failing
        except Exception as exc:  # noqa: BLE001 - the Spark job is the way every batch can take
            log.warning("batch %d: the driver could not write it (%s); running its Spark job", batch_id, exc)
            return None
        name = self.database.name
        committed = [
            self._commit_batch(i, sink, lambda sink=sink: spooled_outgoing(spool_slice(path, 0, rows), sink, name))
            for i, sink in self.batch_sinks
        ]
        return results, committed

    def _deliver(self, projected: DataFrame) -> tuple[pa.Table, list[pa.Table]]:
        """Write and push a projected batch (``project_batch``); the tasks' reports of the stream
        job and of each push job."""
        # a spooled batch is one job: its tasks also send the push sinks' shares (StreamWriter.write)
        push_jobs = self.push_sinks if self.payload == "full" else []
        reread = bool(push_jobs or (self.batch_sinks and self.payload == "full"))
        if reread:
            projected = projected.persist()  # rendered once, read by the stream job and each push job
        try:
            results = self._write(projected).toArrow()
            truncated = sorted(set(pc.list_flatten(results.column("truncated")).to_pylist())) if push_jobs else []
            pushed = [self._push_sink(projected, i, sink, truncated) for i, sink in push_jobs]
            # batched kinds last: the driver has the whole batch's messages of the sink, written at once
            name = self.database.name
            pushed += [
                self._commit_batch(i, sink, lambda i=i, sink=sink: batch_outgoing(projected, i, sink, name))
                for i, sink in self.batch_sinks
            ]
        finally:
            if reread:
                projected.unpersist()
        return results, pushed

    def _commit_batch(self, i: int, sink: SinkConfig, read: Callable[[], Outgoing]) -> pa.Table:
        """Hand batched sink ``i``'s messages of the batch (``read()``: ``batch_outgoing`` or
        ``spooled_outgoing``) to its kind (``DestinationKind.commit_batch``: durable, or parked, when
        it returns; raising fails the batch); a one-row report as the tasks'."""
        started = time.monotonic()
        messages = read()
        delivered, parked = sink.destination.kind.commit_batch(self.config, sink, messages, self._visibility)
        return pa.Table.from_pydict(
            {
                "rows": [len(messages)],
                "written": [0],
                "max_lsn": [max(messages.commit_lsn, default=None)],
                "store_seconds": [time.monotonic() - started],
                "delivered": [delivered],
                "parked": [parked],
                "open_lsn": [None],
                "truncated": [[]],
                **sink_report(len(self.sinks), i, delivered, parked),
            },
            schema=WRITE_RESULT_SCHEMA,
        )

    def _deliver_around_poison(self, df: DataFrame, batch_id: int, error: Exception) -> tuple[pa.Table, list[pa.Table]]:
        """The batch failed with ``error``: if sinks' filters fail on some of its changes
        (``poison.isolate``), park those changes for those sinks and deliver the batch without
        them; otherwise (or if the batch cannot even be read) fail with ``error``.

        Tasks of the failed run may have written or sent part of the batch: the store ignores
        what it has, and push sinks may get a message twice (at least once, as after a restart)."""
        if self.payload != "full" or not any(s.filter for s in self.sinks):
            raise error
        changes = df.persist()  # bisection reads the batch once per range
        try:
            try:
                changes.count()
            except Exception:  # noqa: BLE001 - the batch itself cannot be read: not a filter's doing
                raise error from None
            failed = isolate(changes, self.sinks)
            if not failed and not engine_error(error):
                raise error
            if failed:
                parked = self._park_filter_failures(changes, failed)
                log.warning(
                    "batch %d: %d changes parked for sinks whose filter fails on them (%s); delivering the rest",
                    batch_id,
                    parked,
                    ", ".join(self.sinks[i].name for i in failed),
                )
            # Spark hoists a subexpression used twice (two sinks with one filter) out of the ANDs
            # that guard it and evaluates it on every row (measured: a row whose filter failed
            # failed the batch again). Without that, a failed row's filter is never run
            # (project_batch tests the position first, and AND stops at false), and a filter runs
            # on its own sink's tables only (the error may have been another table's row: then
            # nothing was isolated, and this run delivers the batch or fails with its error).
            conf = changes.sparkSession.conf
            before = conf.get(SUBEXPRESSION_ELIMINATION, None)
            conf.set(SUBEXPRESSION_ELIMINATION, "false")
            try:
                return self._deliver(project_batch(changes, self.sinks, failed))
            finally:
                if before is None:
                    conf.unset(SUBEXPRESSION_ELIMINATION)
                else:
                    conf.set(SUBEXPRESSION_ELIMINATION, before)
        finally:
            changes.unpersist()

    def _park_filter_failures(self, changes: DataFrame, failed: Mapping[int, Mapping[str, str]]) -> int:
        """Park, before the batch is delivered, the changes each sink's filter fails on, with their
        change rows (to run the filter again on retry) and errors; the writers then hold the
        later messages of their groups behind them (``buffer.parked_heads``). Returns how many."""
        keys = sorted({k for positions in failed.values() for k in positions})
        columns = [F.col(f"{c}_json").alias(c) if c in JSON_COLUMNS else F.col(c) for c in CHANGE_FIELD_NAMES]
        columns += [
            F.expr(group_expression(self.sinks[i])).alias(f"_group_{i}") for i in failed if group_in_jvm(self.sinks[i])
        ]
        table = (
            parse_changes(changes.where(position_key().isin(keys)), parse=True)
            .select(*columns)
            .toArrow()
            .sort_by([("commit_lsn", "ascending"), ("commit_idx", "ascending")])
            .combine_chunks()
        )
        rows: list[ParkRow] = []
        for i, positions in failed.items():
            sink = self.sinks[i]
            where = [
                key_of(lsn, idx) in positions
                for lsn, idx in zip(table.column("commit_lsn").to_pylist(), table.column("commit_idx").to_pylist())
            ]
            mine = table.filter(pa.array(where, pa.bool_())).to_batches()
            if not mine:
                continue
            batch = mine[0] if len(mine) == 1 else pa.Table.from_batches(mine).combine_chunks().to_batches()[0]
            group = batch.column(f"_group_{i}") if f"_group_{i}" in batch.schema.names else None
            rendered = render(batch, SinkRendering.of(sink, self.database.name), group)
            changes_of = batch.select(list(CHANGE_FIELD_NAMES)).to_pylist()
            for j, change in enumerate(changes_of):
                lsn, idx = change["commit_lsn"], change["commit_idx"]
                rows.append(
                    ParkRow(
                        sink.name,
                        lsn,
                        idx,
                        rendered.group_id[j].as_py(),
                        rendered.idempotency_key[j].as_py(),
                        None,
                        change_source(change),
                        1,
                        positions[key_of(lsn, idx)],
                        backoff_seconds(1),
                    )
                )
        schema = self.config.store.schema
        self._visibility.retrying(lambda conn: park_messages(conn, schema, rows))
        per_sink: dict[str, int] = {}
        for row in rows:
            per_sink[row.sink] = per_sink.get(row.sink, 0) + 1
        self.metrics.park(per_sink)
        return len(rows)

    def _push_sink(self, projected: DataFrame, i: int, sink: SinkConfig, truncated: list[str]) -> pa.Table:
        """Deliver a push sink's messages of a ``payload=full`` batch: partitioned by group, in
        position order within each partition, so a group is sent in order by one task; a table
        truncated in the batch (``truncated``, ``table_keys``) is one partition, as a truncate is a
        barrier for its table (for a sink that does not group, for all of it). Returns the tasks' reports."""
        columns = [F.col(c) for c in RENDER_COLUMNS] + [F.col(f"_select_{i}"), F.col(f"_group_{i}")]
        partitions = max(2, int(projected.sparkSession.sparkContext.defaultParallelism))
        share = F.col(f"_group_{i}")
        if truncated and "truncate" in selected_actions(sink):
            table = F.concat(F.col("table_schema"), F.lit("\0"), F.col("table_name"))
            share = (
                F.lit("")
                if not sink.message_grouping
                else F.when(table.isin(truncated), F.concat(F.lit("\0"), table)).otherwise(share)
            )
        ordered = (
            projected.where(F.col(f"_select_{i}"))
            .select(*columns)
            .repartition(partitions, share)
            .sortWithinPartitions("commit_lsn", "commit_idx")
        )
        return self._push[sink.name](ordered).toArrow()

    def _record_status(self, batch_id: int, rows: int, elapsed: float, end_lsn: int | None) -> None:
        """Best effort: the status row is for operators; the data path does not depend on it."""
        now = datetime.now(timezone.utc)
        fields: dict[str, Any] = {
            "slot": self.database.slot.name,
            "heartbeat_at": now,
            "last_batch_id": batch_id,
            "last_batch_at": now,
        }
        if rows:
            fields.update(
                batch_rows=rows,
                batch_latency_ms=elapsed * 1000.0,
                rows_per_sec=rows / elapsed if elapsed > 0 else None,
                last_commit_lsn=end_lsn,
            )
        try:
            if self._status_conn is None or self._status_conn.closed:
                self._status_conn = psycopg.connect(self.config.store_dsn(self.database.name), connect_timeout=5)
            store.update_status(
                self._status_conn, self.config.store.schema, self.database.name, add_rows=rows, **fields
            )
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
        if self._driver_writer is not None:
            self._driver_writer.close()
