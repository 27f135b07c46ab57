"""Changes a sink's filter fails on (DESIGN §2.4, §2.6): found in a failed micro-batch, parked, and
evaluated again on retry.

A filter is Spark SQL run by the JVM over the whole batch, and a runtime error of one row (an
invalid or overflowing ANSI cast, a division by zero) fails the job. The batch's first run is not
changed (no extra Spark job while no row fails). When it fails, ``isolate`` caches the batch,
evaluates each filtered sink's selection alone (one job per sink) to learn which filter fails, and
bisects that sink's candidate rows by position (one job per range: about 2·k·log2(n/k) jobs for k
failing rows of n) down to the failing rows and each one's error. The pipeline then parks them and
runs the batch again without them (``project_batch(..., failed=...)``).

On retry (``sequin buffer retry``, the retry operator: no stream app involved) the parked change is
run through the sink's current selection by ``FilterCheck``: a local Spark session, started on the
first parked filter failure a retry meets, evaluates the same SQL (``selection_predicate``) over
the same parsed columns (``parse_changes``) as the stream, so a filter means one thing everywhere.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

import pyarrow as pa
from pyspark.errors.exceptions.captured import CapturedException, PythonException
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sequin_provider.buffer import Filtered, FilterFailed
from sequin_provider.change_arrow import rows_to_arrow
from sequin_provider.config import SinkConfig
from sequin_provider.delivery import selection_predicate
from sequin_provider.message_render import SinkRendering, selection
from sequin_provider.messages import CHANGE_FIELD_NAMES, CHANGE_SCHEMA_DDL

log = logging.getLogger(__name__)

RECORD_MAP = "map<string,string>"
JSON_COLUMNS = ("record", "changes")


def parse_changes(df: DataFrame, parse: bool) -> DataFrame:
    """Change rows with ``record``/``changes`` as JSON text in ``record_json``/``changes_json`` and,
    when ``parse``, as ``map<string,string>`` in ``record``/``changes`` (what sinks' SQL sees)."""
    columns: list[Column] = [F.col(c) for c in CHANGE_FIELD_NAMES if c not in JSON_COLUMNS]
    columns += [F.col(c).alias(f"{c}_json") for c in JSON_COLUMNS]
    if parse:
        columns += [F.from_json(c, RECORD_MAP).alias(c) for c in JSON_COLUMNS]
    return df.select(*columns)


def position_key() -> Column:
    """A change's position as ``lsn:idx`` text (unique in a batch: the buffer's key with the sink)."""
    return F.concat_ws(":", F.col("commit_lsn").cast("string"), F.col("commit_idx").cast("string"))


def key_of(lsn: int, idx: int) -> str:
    """``position_key`` of a position, in Python."""
    return f"{lsn}:{idx}"


def filter_error(sink: SinkConfig, exc: BaseException) -> str:
    """The buffer's error for a change the sink's filter failed on: sink, filter and the engine's
    reason (its first line, e.g. ``[CAST_INVALID_INPUT] The value 'NaN' ...``)."""
    text = str(exc).strip()
    reason = text.splitlines()[0] if text else type(exc).__name__
    return f'sink {sink.name}: filter "{sink.filter}" failed: {reason}'


def engine_error(exc: BaseException) -> bool:
    """Whether a failed job's error is Spark's own (an expression's runtime error), not one raised
    by Python code in a task (a store or network error of a writer)."""
    return isinstance(exc, CapturedException) and not isinstance(exc, PythonException)


def _span(first: tuple[int, int], last: tuple[int, int]) -> Column:
    """Rows whose position lies in ``[first, last]``."""
    lsn, idx = F.col("commit_lsn"), F.col("commit_idx")
    after = (lsn > F.lit(first[0])) | ((lsn == F.lit(first[0])) & (idx >= F.lit(first[1])))
    before = (lsn < F.lit(last[0])) | ((lsn == F.lit(last[0])) & (idx <= F.lit(last[1])))
    return after & before


def _failure(parsed: DataFrame, sink: SinkConfig, span: tuple[tuple[int, int], tuple[int, int]] | None) -> str | None:
    """The error of the sink's selection over the rows in ``span`` (all rows: None), or None when it
    evaluates on all of them. The range is filtered first, so the selection runs on those rows only."""
    rows = parsed if span is None else parsed.where(_span(*span))
    try:
        rows.agg(F.count_if(F.coalesce(F.expr(selection_predicate(sink)), F.lit(False)))).collect()
    except CapturedException as exc:
        return filter_error(sink, exc)
    return None


def isolate(changes: DataFrame, sinks: tuple[SinkConfig, ...]) -> dict[int, dict[str, str]]:
    """The rows each sink's filter fails on: ``{sink index: {position key: error}}`` over the
    batch's change rows ``changes`` (cache them: each range is one job over them)."""
    parsed = parse_changes(changes, parse=True)
    found: dict[int, dict[str, str]] = {}
    for i, sink in enumerate(sinks):
        if not sink.filter or (error := _failure(parsed, sink, None)) is None:
            continue
        # the rows the filter is evaluated on: the sink's tables and actions, in position order
        base = selection_predicate(sink, with_filter=False)
        table = parsed.where(F.expr(base)).select("commit_lsn", "commit_idx").toArrow()
        positions = sorted(zip(table.column("commit_lsn").to_pylist(), table.column("commit_idx").to_pylist()))
        if not positions:
            continue
        failing: dict[str, str] = {}
        # (lo, hi, error of evaluating exactly positions[lo:hi], or None: known to fail, not evaluated)
        ranges: list[tuple[int, int, str | None]] = [(0, len(positions), error)]
        while ranges:
            lo, hi, error = ranges.pop()
            if hi - lo == 1:
                error = error or _failure(parsed, sink, (positions[lo], positions[lo]))
                if error:
                    failing[key_of(*positions[lo])] = error
                continue
            mid = (lo + hi) // 2
            low = _failure(parsed, sink, (positions[lo], positions[mid - 1]))
            if low is None:  # the upper half holds the failure (a filter is evaluated row by row)
                ranges.append((mid, hi, None))
                continue
            high = _failure(parsed, sink, (positions[mid], positions[hi - 1]))
            if high is not None:
                ranges.append((mid, hi, high))
            ranges.append((lo, mid, low))
        if failing:
            found[i] = failing
            log.warning(
                "sink %s: its filter fails on %d of %d changes of the batch (parked): %s",
                sink.name,
                len(failing),
                len(positions),
                next(iter(failing.values())),
            )
    return found


def without_failed(predicate: Column, keys: Mapping[str, str] | None) -> Column:
    """``predicate``, false on the rows at ``keys`` (the filter is not evaluated there)."""
    if not keys:
        return predicate
    return ~position_key().isin(list(keys)) & predicate


class FilterCheck:
    """Evaluates sinks' current selection (tables, actions, filter) on parked changes, for retries.

    A sink without a filter needs no Spark (``message_render.selection``); with one, a local Spark
    session (one core) is started on first use and stopped by ``close`` if this made it."""

    def __init__(self) -> None:
        self._spark: Any = None
        self._owned = False
        self._lock = threading.Lock()

    def change_batch(self, change: Mapping[str, Any]) -> pa.RecordBatch:
        """A parked change row (``buffer.parked_change``) as a one-row Arrow batch of change rows."""
        return rows_to_arrow([tuple(change.get(c) for c in CHANGE_FIELD_NAMES)])

    def takes(self, sink: SinkConfig, rendering: SinkRendering, change: Mapping[str, Any]) -> bool:
        """Whether the sink takes the change now; raises ``FilterFailed`` (its error as the stream
        words it) when the filter fails on it again."""
        if not sink.filter:
            return bool(selection(self.change_batch(change), rendering)[0].as_py())
        row = tuple(change.get(c) for c in CHANGE_FIELD_NAMES)
        spark = self._session()
        try:
            df = parse_changes(spark.createDataFrame([row], CHANGE_SCHEMA_DDL), parse=True)
            return bool(df.select(F.coalesce(F.expr(selection_predicate(sink)), F.lit(False))).collect()[0][0])
        except CapturedException as exc:
            raise FilterFailed(filter_error(sink, exc)) from None

    def passes(self, sink: SinkConfig, rendering: SinkRendering, change: Mapping[str, Any]) -> None:
        """Raise ``Filtered`` unless the sink takes the change (``takes``)."""
        if not self.takes(sink, rendering, change):
            raise Filtered(
                f"sink {sink.name}: the filter does not take change {change.get('commit_lsn')}:"
                f"{change.get('commit_idx')}"
            )

    def _session(self) -> Any:
        with self._lock:
            if self._spark is None:
                from pyspark.sql import SparkSession

                from sequin_provider.spark.app import spark_session

                active = SparkSession.getActiveSession()
                if active is not None:
                    self._spark = active
                else:
                    log.info("starting a local Spark session to evaluate sinks' filters on parked changes")
                    self._spark, self._owned = spark_session("sequin-buffer-retry", master="local[1]"), True
            return self._spark

    def close(self) -> None:
        """Stop the Spark session if this started it."""
        with self._lock:
            if self._spark is not None and self._owned:
                self._spark.stop()
            self._spark, self._owned = None, False
