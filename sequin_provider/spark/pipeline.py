"""The micro-batch pipeline (``foreachBatch``): select, filter, group and hand to the sinks.

One Spark action per micro-batch: the JVM evaluates every sink's selection and group SQL over
the batch, the result comes back as one Arrow table, and each sink's messages are rendered and
written. The batch completes (and the slot may advance) only after every sink has written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sequin_provider import store
from sequin_provider.config import ConfigError, SequinConfig, SinkConfig
from sequin_provider.delivery import (
    MessageRenderer,
    group_expression,
    needs_parsed_record,
    selection_predicate,
)
from sequin_provider.messages import CHANGE_FIELD_NAMES
from sequin_provider.sinks.sequin_stream import SequinStreamSink
from sequin_provider.store import StreamRow

log = logging.getLogger(__name__)

RECORD_MAP = "map<string,string>"


@dataclass
class BatchStats:
    """What one micro-batch did."""

    batch_id: int
    rows_in: int
    messages_written: int
    seconds: float
    end_lsn: int | None
    spark_seconds: float = 0.0
    render_seconds: float = 0.0
    write_seconds: float = 0.0


def project_batch(df: DataFrame, sinks: tuple[SinkConfig, ...]) -> DataFrame:
    """The batch with every sink's selection flag (``_select_i``) and group id (``_group_i``)."""
    base = [F.col(c) for c in CHANGE_FIELD_NAMES]
    if any(needs_parsed_record(s) for s in sinks):
        # Sink SQL sees record/changes as maps; the JSON text travels on as _record/_changes.
        df = df.select(*[c for c in CHANGE_FIELD_NAMES if c not in ("record", "changes")],
                       F.col("record").alias("_record"), F.col("changes").alias("_changes"),
                       F.from_json("record", RECORD_MAP).alias("record"),
                       F.from_json("changes", RECORD_MAP).alias("changes"))
        base = [F.col(c) for c in CHANGE_FIELD_NAMES if c not in ("record", "changes")]
        base += [F.col("_record").alias("record"), F.col("_changes").alias("changes")]
    extra = []
    for i, sink in enumerate(sinks):
        extra.append(F.expr(selection_predicate(sink)).alias(f"_select_{i}"))
        extra.append(F.expr(group_expression(sink)).alias(f"_group_{i}"))
    return df.select(*base, *extra)


class Pipeline:
    """Per-database delivery: every sink of ``database`` is served from one change stream."""

    def __init__(self, config: SequinConfig, database: str) -> None:
        self.config = config
        self.database = config.database(database)
        self.sinks: tuple[SinkConfig, ...] = config.sinks_of(self.database.name)
        self.renderers = [MessageRenderer(s, self.database.name) for s in self.sinks]
        self.stream_sink = SequinStreamSink(config.store_dsn(self.database.name), config.store.schema,
                                            config.stream.store_retry_timeout)
        self._status_conn: Any = None
        self.last_stats: BatchStats | None = None
        for sink in self.sinks:
            if sink.destination.type != "sequin_stream":
                raise ConfigError(config.source, f"sinks.{sink.name}.destination.type",
                                  f"{sink.destination.type!r} sinks are not delivered by this version yet")

    def validate(self, spark: Any) -> None:
        """Analyse every sink's SQL on an empty batch, so a bad filter fails at start with its sink named."""
        from sequin_provider.messages import CHANGE_SCHEMA_DDL

        empty = spark.createDataFrame([], CHANGE_SCHEMA_DDL)
        for i, sink in enumerate(self.sinks):
            try:
                project_batch(empty, (sink,)).schema  # noqa: B018 - forces analysis
            except Exception as exc:  # noqa: BLE001 - AnalysisException / ParseException
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(self.config.source, f"sinks[{i}].filter", f"invalid SQL: {first}") from None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """``foreachBatch`` entry point."""
        started = time.monotonic()
        table = project_batch(df, self.sinks).toArrow()
        collected = rendered = time.monotonic()
        rows_in = table.num_rows
        written = 0
        end_lsn = None
        if rows_in:
            columns = {name: table.column(name).to_pylist() for name in CHANGE_FIELD_NAMES}
            out: list[StreamRow] = []
            for i, (sink, renderer) in enumerate(zip(self.sinks, self.renderers)):
                selected = table.column(f"_select_{i}").to_pylist()
                indices = [j for j, keep in enumerate(selected) if keep]
                if not indices:
                    continue
                groups = table.column(f"_group_{i}").to_pylist()
                lsn, idx = columns["commit_lsn"], columns["commit_idx"]
                for j, data in zip(indices, renderer.render(columns, indices)):
                    out.append((sink.name, lsn[j], idx[j], groups[j], f"{lsn[j]}:{idx[j]}", data))
            rendered = time.monotonic()
            written = self.stream_sink.write(out)
            end_lsn = max(columns["commit_lsn"])
        finished = time.monotonic()
        elapsed = finished - started
        stats = BatchStats(batch_id, rows_in, written, elapsed, end_lsn, collected - started, rendered - collected,
                           finished - rendered if rows_in else 0.0)
        self.last_stats = stats
        self._record_status(batch_id, rows_in, elapsed, end_lsn)
        if rows_in:
            log.info("batch %d: %d changes -> %d new messages in %.3fs (spark %.3fs, render %.3fs, store %.3fs)",
                     batch_id, rows_in, written, elapsed, stats.spark_seconds, stats.render_seconds,
                     stats.write_seconds)

    def _record_status(self, batch_id: int, rows: int, elapsed: float, end_lsn: int | None) -> None:
        """Best effort: the status row is for operators; the data path does not depend on it."""
        import psycopg

        fields: dict[str, Any] = {"slot": self.database.slot.name, "heartbeat_at": _now(),
                                  "last_batch_id": batch_id, "last_batch_at": _now()}
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
            self._status_conn = None

    def close(self) -> None:
        """Release store connections."""
        self.stream_sink.close()
        if self._status_conn is not None:
            self._status_conn.close()


def _now() -> Any:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc)
