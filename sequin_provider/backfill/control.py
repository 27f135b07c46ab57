"""Backfills: keyset pages sized to a query-time budget (DESIGN §7, reference/000 and 004).

This module holds the parts of a backfill that need neither Spark nor Airflow:
``PageSizeOptimizer``, which picks the next keyset page size from how long recent pages took,
``plan_backfill``/``create_backfill``, which validate a request and record it, and
``progress_line``. Reading pages is ``backfill.reader``; the Spark app is ``spark.backfill_app``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import psycopg
from psycopg import sql

from sequin_provider import store
from sequin_provider.backfill.row_filter import check_row_filter, row_filter_sql
from sequin_provider.config import SequinConfig, TableConfig, UnknownSinkError
from sequin_provider.replication import table_info
from sequin_provider.session_lock import SessionLock
from sequin_provider.store import BackfillError

DEFAULT_MAX_QUERY_MS = 5000
DEFAULT_MAX_PAGE_ROWS = 50_000
DEFAULT_WINDOW_TIMEOUT = 600.0
DEFAULT_PAGES_IN_FLIGHT = 3
"""A range reader's defaults (``reader.RangeReader``): the largest page, how long a staged page waits
for the stream app to take it, and how many pages it stages ahead. Here, not in ``reader``, so the
CLI's options know them without loading the readers' dependencies."""


@dataclass(frozen=True)
class PageObservation:
    """One page query: how many rows were asked for, how long it took, whether it hit the budget."""

    page_size: int
    elapsed_ms: float
    timed_out: bool


class PageSizeOptimizer:
    """Chooses keyset page sizes so each page query finishes comfortably inside ``max_query_ms``.

    It models a page's time as proportional to its size, estimated from the last ``history``
    observations, and aims at ``target_fraction`` of the budget. A timed-out query counts as a
    measurement at the budget (the real time was at least that). Pages grow while queries finish
    well under the budget and shrink on timeouts; each step is clamped to 0.5×–2× of the current
    size, and the size stays below the smallest recent timeout and, after a timeout, converges
    between the largest recent success and that timeout.
    """

    def __init__(
        self,
        max_query_ms: float = 5000.0,
        initial_size: int = 1000,
        min_size: int = 10,
        max_size: int = 1_000_000,
        target_fraction: float = 0.5,
        history: int = 20,
    ) -> None:
        if max_query_ms <= 0:
            raise ValueError("max_query_ms must be positive")
        if not 0 < target_fraction < 1:
            raise ValueError("target_fraction must be between 0 and 1")
        if not 1 <= min_size <= max_size:
            raise ValueError("need 1 <= min_size <= max_size")
        self.max_query_ms = max_query_ms
        self.min_size = min_size
        self.max_size = max_size
        self.target_fraction = target_fraction
        self._size = min(max(initial_size, min_size), max_size)
        self._history: deque[PageObservation] = deque(maxlen=history)

    @property
    def size(self) -> int:
        """The page size to use for the next query."""
        return self._size

    @property
    def observations(self) -> tuple[PageObservation, ...]:
        """The recent observations the estimate is based on (oldest first)."""
        return tuple(self._history)

    def observe(self, page_size: int, elapsed_ms: float, timed_out: bool = False) -> int:
        """Record a page query and return the next page size."""
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        elapsed = self.max_query_ms if timed_out else max(float(elapsed_ms), 0.0)
        self._history.append(PageObservation(page_size, elapsed, timed_out))
        self._size = self._next_size(page_size)
        return self._size

    def _next_size(self, current: int) -> int:
        target_ms = self.target_fraction * self.max_query_ms
        # ms per row from the recent pages (a timeout contributes budget / size: a lower bound)
        rates = sorted(o.elapsed_ms / o.page_size for o in self._history)
        ms_per_row = rates[len(rates) // 2]
        proposed = self.max_size if ms_per_row <= 0 else int(target_ms / ms_per_row)
        proposed = max(int(current * 0.5), min(proposed, current * 2))  # one step: 0.5x .. 2x
        timeouts = [o.page_size for o in self._history if o.timed_out]
        if timeouts:
            smallest_timeout = min(timeouts)
            if self._history[-1].timed_out:
                proposed = min(proposed, max(int(current * 0.5), 1))
            successes = [o.page_size for o in self._history if not o.timed_out and o.page_size < smallest_timeout]
            ceiling = smallest_timeout - 1
            if successes and proposed >= smallest_timeout:
                ceiling = (max(successes) + smallest_timeout) // 2  # bisect between success and timeout
            proposed = min(proposed, max(ceiling, 1))
        return min(max(proposed, self.min_size), self.max_size)


@dataclass(frozen=True)
class BackfillPlan:
    """A validated backfill request: the sink's table, its keys, and the typed start position."""

    sink: str
    table: TableConfig
    primary_key: tuple[str, ...]
    kind: str
    sort_column: str | None
    sort_type: str | None
    start_position: str | None
    max_query_ms: int
    estimated_rows: int | None
    where: str | None = None  # the SQL condition its rows match (``backfill.row_filter``)


def plan_backfill(
    source: psycopg.Connection[Any],
    config: SequinConfig,
    sink_name: str,
    table_name: str,
    sort_column: str | None = None,
    start_position: str | None = None,
    max_query_ms: int = DEFAULT_MAX_QUERY_MS,
    where: str | None = None,
) -> BackfillPlan:
    """Check a backfill request against the config and the source catalog (DESIGN §2.6).

    A request with ``sort_column`` is partial: rows with ``sort_column >= start_position`` in
    ``(sort_column, primary key)`` order. ``where``: only the rows matching this SQL condition
    (checked by the source: ``row_filter.check_row_filter``; empty: every row). Raises
    ``BackfillError`` naming what is wrong.
    """
    try:
        sink = config.sink(sink_name)
    except UnknownSinkError as exc:
        raise BackfillError(exc.reason) from None
    qualified = table_name if "." in table_name else f"public.{table_name}"
    table = next((t for t in sink.tables if t.qualified == qualified), None)
    if table is None:
        raise BackfillError(
            f"sink {sink_name!r} does not capture {qualified} "
            f"(its tables: {', '.join(t.qualified for t in sink.tables)})"
        )
    store.check_max_query_ms(max_query_ms)
    check_backfill_source(source)
    info = table_info(source, table)
    if info is None:
        raise BackfillError(f"table {qualified} does not exist in database {sink.database!r}")
    if not info.primary_key:
        raise BackfillError(f"table {qualified} has no primary key: keyset pages need one")
    sort_type = None
    if sort_column is None:
        if start_position is not None:
            raise BackfillError("a start position needs a sort column (a partial backfill)")
    else:
        row = source.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s AND attname = %s"
            " AND attnum > 0 AND NOT attisdropped",
            (info.oid, sort_column),
        ).fetchone()
        if row is None:
            raise BackfillError(
                f"sort column {sort_column!r} is not a column of {qualified} (columns: {', '.join(info.columns)})"
            )
        sort_type = str(row[0])
        if start_position is None:
            raise BackfillError(f"a partial backfill needs a start position for {sort_column!r} ({sort_type})")
        try:
            with source.transaction():
                source.execute(sql.SQL("SELECT CAST(%s AS {})").format(sql.SQL(sort_type)), (start_position,))
        except psycopg.Error as exc:
            raise BackfillError(
                f"start position {start_position!r} is not a valid {sort_type} for {sort_column!r}: "
                f"{str(exc).strip().splitlines()[0]}"
            ) from None
    where = check_row_filter(source, sql.Identifier(table.schema, table.name), where)
    return BackfillPlan(
        sink.name,
        table,
        info.primary_key,
        "partial" if sort_column else "full",
        sort_column,
        sort_type,
        start_position,
        max_query_ms,
        _estimate_rows(source, table, sort_column, sort_type, start_position, where),
        where,
    )


def _estimate_rows(
    source: psycopg.Connection[Any],
    table: TableConfig,
    sort_column: str | None,
    sort_type: str | None,
    start_position: str | None,
    where: str | None = None,
) -> int | None:
    """The planner's row estimate (cheap on any table size), for progress and ETA."""
    conditions: list[sql.Composable] = []
    if sort_column is not None and sort_type is not None:
        conditions.append(
            sql.SQL("{} >= CAST({} AS {})").format(
                sql.Identifier(sort_column), sql.Literal(start_position), sql.SQL(sort_type)
            )
        )
    if where is not None:
        conditions.append(row_filter_sql(where))
    query = sql.SQL("EXPLAIN (FORMAT JSON) SELECT 1 FROM {}").format(sql.Identifier(table.schema, table.name))
    if conditions:  # no parameters: a condition's % is not a placeholder
        query = sql.SQL("{} WHERE {}").format(query, sql.SQL(" AND ").join(conditions))
    try:
        plan = source.execute(query).fetchone()[0]  # type: ignore[index]
        return int(plan[0]["Plan"]["Plan Rows"])
    except (psycopg.Error, KeyError, IndexError, TypeError):
        return None


def create_backfill(
    source: psycopg.Connection[Any],
    store_conn: psycopg.Connection[Any],
    config: SequinConfig,
    sink_name: str,
    table_name: str,
    sort_column: str | None = None,
    start_position: str | None = None,
    max_query_ms: int = DEFAULT_MAX_QUERY_MS,
    requested_by: str | None = None,
    where: str | None = None,
) -> store.Backfill:
    """Validate a backfill request and record it as pending (nothing is recorded when it is invalid);
    ``requested_by`` names who asked (an Airflow task instance), so that its retry can find it;
    ``where``: only the rows matching this SQL condition (``plan_backfill``)."""
    plan = plan_backfill(source, config, sink_name, table_name, sort_column, start_position, max_query_ms, where)
    return store.create_backfill(
        store_conn,
        config.store.schema,
        plan.sink,
        plan.table.schema,
        plan.table.name,
        plan.kind,
        plan.sort_column,
        plan.start_position,
        plan.max_query_ms,
        plan.estimated_rows,
        requested_by,
        plan.where,
    )


RUN_LOCK_WAIT = 30.0  # seconds an app waits for an earlier app of the same backfill to stop


class BackfillBusy(BackfillError):
    """Another app is running the backfill (it holds the backfill's run lock)."""


def run_lock(store_dsn: str, schema: str, backfill_id: int, application_name: str = "sequin-backfill") -> SessionLock:
    """The advisory lock "one app runs this backfill", in the store: the backfill app holds it while it
    runs, so two runs of one backfill (a retried task beside its orphaned app, two ``sequin backfill
    run``) never read the same ranges at once; Postgres frees it when the app's session ends."""
    return SessionLock(store_dsn, f"sequin-backfill:{schema}:{backfill_id}", application_name)


def server_lock(
    store_dsn: str, schema: str, database: str, application_name: str = "sequin-backfill-server"
) -> SessionLock:
    """The advisory lock "a backfill server runs this database's backfills", in the store: held by
    ``sequin backfill serve`` while it is up, so that ``sequin backfill start`` hands it the backfill
    instead of starting a Spark app of its own, and two servers never poll one store."""
    return SessionLock(store_dsn, f"sequin-backfill-server:{schema}:{database}", application_name)


def run_lock_holder(
    store_dsn: str, schema: str, backfill_id: int, wait: float, application_name: str = "sequin-backfill"
) -> str | None:
    """Who runs the backfill: the holder of its run lock if it is still held after ``wait`` seconds,
    else None (nobody runs it; the lock is tried and released at once)."""
    lock = run_lock(store_dsn, schema, backfill_id, application_name)
    try:
        return None if lock.acquire_within(wait) else lock.holder()
    finally:
        lock.release()


@dataclass(frozen=True)
class Placement:
    """Where a recorded backfill runs: ``elsewhere`` (another app holds its run lock), ``server`` (the
    backfill server of its database takes it as recorded; ``server`` is that server's lock, to follow
    it with ``follow_backfill``) or ``here`` (the caller runs it)."""

    where: str
    holder: str | None = None
    server: SessionLock | None = None


def place_backfill(
    store_dsn: str,
    schema: str,
    database: str,
    backfill_id: int,
    takeover_wait: float | None = None,
    application_name: str = "sequin-backfill",
) -> Placement:
    """Decide where backfill ``backfill_id`` of ``database`` runs (``sequin backfill start`` and
    ``SequinBackfillOperator`` both ask this). ``takeover_wait``: the backfill may already be run by an
    earlier app (a retried task resuming its own backfill): give that app this many seconds to let go
    of the run lock before deciding it runs elsewhere; None: a new backfill, nobody runs it yet."""
    if takeover_wait is not None:
        holder = run_lock_holder(store_dsn, schema, backfill_id, takeover_wait, application_name)
        if holder is not None:
            return Placement("elsewhere", holder)
    server = server_lock(store_dsn, schema, database, application_name)
    if server.held_elsewhere():
        return Placement("server", server.holder(), server)
    return Placement("here")


SERVE_POLL_INTERVAL = 1.0
"""Seconds a backfill server waits between looks at its stores when no ``NOTIFY`` wakes it."""
FOLLOW_POLL_INTERVAL = 0.2
FOLLOW_PROGRESS_INTERVAL = 5.0
SERVER_CHECK_INTERVAL = 5.0


def follow_backfill(
    store_dsn: str, schema: str, backfill_id: int, server: SessionLock, report: Callable[[str], None] = print
) -> store.Backfill | None:
    """Follow a backfill that the backfill server (``server_lock``) runs, reporting a progress line
    every few seconds, until it ends: its final record, or None when the server went away first
    (the caller then runs it itself; it resumes from its cursors)."""
    last_report = last_check = time.monotonic()
    with psycopg.connect(store_dsn, autocommit=True, connect_timeout=10) as conn:
        while True:
            backfill = store.get_backfill(conn, schema, backfill_id)
            if backfill.state not in store.ACTIVE_BACKFILL_STATES:
                return backfill
            now = time.monotonic()
            if now - last_report >= FOLLOW_PROGRESS_INTERVAL:
                report(f"backfill {backfill_id}: {progress_line(backfill)}")
                last_report = now
            if now - last_check >= SERVER_CHECK_INTERVAL:
                if not server.held_elsewhere():
                    final = store.get_backfill(conn, schema, backfill_id)
                    return final if final.state not in store.ACTIVE_BACKFILL_STATES else None
                last_check = now
            time.sleep(FOLLOW_POLL_INTERVAL)


MIN_SERVER_VERSION = 140000


def check_backfill_source(source: psycopg.Connection[Any]) -> None:
    """Backfills need watermark messages in the replication stream: Postgres 14 or later."""
    version = source.info.server_version
    if version < MIN_SERVER_VERSION:
        raise BackfillError(
            f"backfills need PostgreSQL 14 or later (logical messages in pgoutput); the source is {version // 10000}"
        )


def backfill_rate(backfill: store.Backfill) -> float | None:
    """Rows per second of a backfill since it started (to its end, or its last progress), or None
    before it has read a row."""
    if backfill.started_at is None or not backfill.rows_processed:
        return None
    end = backfill.finished_at or backfill.updated_at
    seconds = (end - backfill.started_at).total_seconds() if end else 0
    return backfill.rows_processed / seconds if seconds > 0 else None


def backfill_eta_seconds(backfill: store.Backfill, rate: float | None) -> int | None:
    """Seconds a running backfill needs for its estimated rows left at ``rate``, or None."""
    done, total = backfill.rows_processed, backfill.rows_initial
    if backfill.state != "running" or not total or not rate or rate <= 0 or total <= done:
        return None
    return int((total - done) / rate)


def progress_line(backfill: store.Backfill, rate: float | None = None) -> str:
    """``rows done / estimated total (percent), rows/s, ETA`` of a backfill, for logs and the CLI."""
    done = backfill.rows_processed
    total = backfill.rows_initial
    parts = [f"{backfill.state}", f"{done:,}/{total:,} rows" if total else f"{done:,} rows"]
    if total:
        parts[-1] += f" ({min(100.0, 100.0 * done / total):.1f}%)"
    if backfill.rows_emitted != done:
        parts.append(f"{backfill.rows_emitted:,} emitted")
    if rate is None:
        rate = backfill_rate(backfill)
    if rate is not None:
        parts.append(f"{rate:,.0f} rows/s")
        eta = backfill_eta_seconds(backfill, rate)
        if eta is not None:
            parts.append(f"ETA {eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}")
    if backfill.error:
        parts.append(f"error: {backfill.error}")
    return ", ".join(parts)


def create_initial_backfills(
    source: psycopg.Connection[Any], store_conn: psycopg.Connection[Any], config: SequinConfig, database: str
) -> list[store.Backfill]:
    """The ``initial_backfill`` of each sink of ``database`` seen for the first time (DESIGN §7).

    Every request is validated before any is recorded, and the sink is marked set up only after
    its backfills exist, so a failed init creates nothing and the next one tries again.
    """
    sinks = [s for s in config.sinks_of(database)]
    created: list[store.Backfill] = []
    for name in store.new_sinks(store_conn, config.store.schema, [s.name for s in sinks]):
        sink = config.sink(name)
        for request in sink.initial_backfill:
            plan_backfill(
                source, config, name, request.table, request.sort_column, request.start_position, request.max_query_ms
            )
        for request in sink.initial_backfill:
            created.append(
                create_backfill(
                    source,
                    store_conn,
                    config,
                    name,
                    request.table,
                    request.sort_column,
                    request.start_position,
                    request.max_query_ms,
                )
            )
        store.record_sink_setup(store_conn, config.store.schema, name)
    return created
