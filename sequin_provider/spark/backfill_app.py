"""The backfill Spark batch app: one task per key range, each reading its range page by page.

The driver starts (or resumes) the backfill, splits the key space once (the ranges and their
cursors are kept in the store, so a restarted backfill continues where each range stopped), runs
the ranges as Spark tasks (``backfill.reader.RangeReader``), logs a progress line every few
seconds, and records the outcome: completed, failed with the error, or left cancelled.

The same app can stay up as a backfill server (``serve_backfills``): it runs each backfill of its
databases as it is recorded, as jobs of its one Spark application, so a backfill does not pay a
Spark start of its own (about 5 s before its first row, half of a 1,000,000-row backfill's time).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg

from sequin_provider import store
from sequin_provider.backfill import (
    DEFAULT_MAX_PAGE_ROWS,
    DEFAULT_WINDOW_TIMEOUT,
    RUN_LOCK_WAIT,
    SERVE_POLL_INTERVAL,
    BackfillBusy,
    check_backfill_source,
    progress_line,
    run_lock,
    server_lock,
)
from sequin_provider.backfill.reader import (
    BackfillStopped,
    RangeReader,
    split_key_ranges,
    table_shape,
)
from sequin_provider.config import ConfigError, SequinConfig, load_config
from sequin_provider.logs import configure_logging
from sequin_provider.spark.worker_heap import freeze_long_lived
from sequin_provider.store import BackfillError

log = logging.getLogger("sequin.backfill")
PROGRESS_INTERVAL = 5.0


def _database_of(config: SequinConfig, sink_name: str) -> str:
    if not config.has_sink(sink_name):
        raise BackfillError(f"the backfill's sink {sink_name!r} is no longer in the config")
    return config.sink(sink_name).database


def read_ranges(config_path: str, database: str, backfill_id: int, max_page_rows: int, window_timeout: float) -> Any:
    """The task body: read each range of the partition; yields one summary row per range."""

    def run(ranges: Iterator[int]) -> Iterator[tuple[int, int, int, int, bool]]:
        freeze_long_lived()  # this runs in a reused Python worker (worker_heap)
        configure_logging()
        config = load_config(config_path)
        for range_idx in ranges:
            result = RangeReader(config, database, backfill_id, range_idx, max_page_rows, window_timeout).run()
            yield (result.range_idx, result.rows_processed, result.rows_emitted, result.stale_pages, result.done)

    return run


def start_backfill(
    config: SequinConfig, database_name: str, backfill_id: int, ranges: int
) -> tuple[store.Backfill, list[store.BackfillRange]]:
    """Move a pending backfill to running with its ranges, or return a running one's ranges (resume).
    ``database_name``: the database whose store holds the backfill (``database_of_backfill``)."""
    with psycopg.connect(config.store_dsn(database_name), connect_timeout=10) as conn:
        backfill = store.get_backfill(conn, config.store.schema, backfill_id)
        database = config.database(database_name)
        if backfill.state in ("completed", "failed", "cancelled"):
            return backfill, store.backfill_ranges(conn, config.store.schema, backfill_id)
        with psycopg.connect(database.dsn, autocommit=True, connect_timeout=10) as source:
            check_backfill_source(source)
            existing = store.backfill_ranges(conn, config.store.schema, backfill_id)
            bounds: list[tuple[Any, Any]] = [(None, None)]
            if not existing and backfill.kind == "full" and ranges > 1:
                shape = table_shape(source, backfill.table_schema, backfill.table_name)
                bounds = split_key_ranges(source, shape, ranges, backfill.rows_initial)
        conn.commit()
        if backfill.state == "pending":
            backfill = store.transition_backfill(conn, config.store.schema, backfill_id, "running")
        found = store.ensure_backfill_ranges(conn, config.store.schema, backfill_id, bounds)
        abandoned = store.abandon_backfill_pages(conn, config.store.schema, backfill_id)
        if abandoned:
            log.info(
                "backfill %d: %d pages of an earlier run were left unfinished; their ranges resume from their cursors",
                backfill_id,
                abandoned,
            )
        return backfill, found


def database_of_backfill(config: SequinConfig, backfill_id: int) -> str:
    """The database of a backfill's sink, found through the store of whichever database holds it."""
    errors = []
    for db in config.databases:
        try:
            with psycopg.connect(config.store_dsn(db.name), connect_timeout=10) as conn:
                sink = store.get_backfill(conn, config.store.schema, backfill_id).sink
        except BackfillError as exc:
            errors.append(str(exc))
            continue
        return _database_of(config, sink)
    raise BackfillError(errors[0] if errors else f"no backfill with id {backfill_id}")


def run_backfill(
    spark: Any,
    config_path: str,
    backfill_id: int,
    ranges: int | None = None,
    max_page_rows: int = DEFAULT_MAX_PAGE_ROWS,
    window_timeout: float = DEFAULT_WINDOW_TIMEOUT,
    stopping: threading.Event | None = None,
    lock_wait: float = RUN_LOCK_WAIT,
) -> store.Backfill:
    """Run (or resume) a backfill to its end on ``spark``; returns its final record.

    Holds the backfill's run lock throughout (``BackfillBusy`` if another app still holds it after
    ``lock_wait`` seconds; the backfill is then left as it is). When ``stopping`` is set (the app's
    supervisor is gone) the Spark job is cancelled by the caller and the backfill stays ``running``,
    to be resumed from its cursors."""
    config = load_config(config_path)
    database = database_of_backfill(config, backfill_id)
    lock = run_lock(
        config.store_dsn(database), config.store.schema, backfill_id, f"sequin-backfill-{backfill_id} pid {os.getpid()}"
    )
    if not lock.acquire_within(lock_wait):
        raise BackfillBusy(
            f"backfill {backfill_id} is being run by another app (its lock {lock.name!r} is held by"
            f" {lock.holder()}); it was left as it is"
        )
    try:
        return _run_locked(
            spark, config, config_path, database, backfill_id, ranges, max_page_rows, window_timeout, stopping
        )
    finally:
        lock.release()


def _run_locked(
    spark: Any,
    config: SequinConfig,
    config_path: str,
    database: str,
    backfill_id: int,
    ranges: int | None,
    max_page_rows: int,
    window_timeout: float,
    stopping: threading.Event | None,
) -> store.Backfill:
    if stopping is not None and stopping.is_set():  # the supervisor went while the lock was awaited
        with psycopg.connect(config.store_dsn(database), connect_timeout=10) as conn:
            current = store.get_backfill(conn, config.store.schema, backfill_id)
        log.warning(
            "backfill %d: the app stopped before it started the backfill; it was left %s", backfill_id, current.state
        )
        return current
    parallelism = ranges or int(spark.sparkContext.defaultParallelism)
    backfill, found = start_backfill(config, database, backfill_id, parallelism)
    dsn = config.store_dsn(database)
    schema = config.store.schema
    if backfill.state != "running":
        log.info("backfill %d is already %s", backfill_id, backfill.state)
        return backfill
    todo = [r.range_idx for r in found if not r.done]
    log.info(
        "backfill %d of %s.%s for sink %r: %d ranges to read (%d done), about %s rows",
        backfill_id,
        backfill.table_schema,
        backfill.table_name,
        backfill.sink,
        len(todo),
        len(found) - len(todo),
        backfill.rows_initial if backfill.rows_initial is not None else "?",
    )
    stop = threading.Event()
    reporter = threading.Thread(target=_report_progress, args=(dsn, schema, backfill_id, stop), daemon=True)
    reporter.start()
    error: str | None = None
    try:
        if todo and not (stopping is not None and stopping.is_set()):  # gone while the ranges were set up
            spark.sparkContext.setJobDescription(f"sequin backfill {backfill_id}")
            rdd = spark.sparkContext.parallelize(todo, len(todo))
            rdd.mapPartitions(
                read_ranges(str(Path(config_path).absolute()), database, backfill_id, max_page_rows, window_timeout)
            ).collect()
    except Exception as exc:  # noqa: BLE001 - a task's error, as Spark reports it
        error = _task_error(exc)
    finally:
        stop.set()
        reporter.join(timeout=10)
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        current = store.get_backfill(conn, schema, backfill_id)
        if current.state != "running":
            log.info("backfill %d is %s", backfill_id, current.state)
            return current
        if stopping is not None and stopping.is_set():
            log.warning(
                "backfill %d: the app stopped before the backfill finished; it stays running (%s) and"
                " resumes from its cursors when run again",
                backfill_id,
                progress_line(current),
            )
            return current
        if error is None and all(r.done for r in store.backfill_ranges(conn, schema, backfill_id)):
            final = store.transition_backfill(conn, schema, backfill_id, "completed")
            log.info("backfill %d completed: %s", backfill_id, progress_line(final))
            return final
        final = store.transition_backfill(conn, schema, backfill_id, "failed", error or "ranges left unfinished")
        log.error("backfill %d failed: %s", backfill_id, final.error)
        return final


def _task_error(exc: Exception) -> str:
    """The useful line of a Spark task failure (the Python exception it carries)."""
    text = str(exc)
    for marker in ("BackfillError: ", "BackfillStopped: ", "QueryCanceled: ", "OperationalError: "):
        if marker in text:
            return text.split(marker, 1)[1].strip().splitlines()[0]
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _report_progress(dsn: str, schema: str, backfill_id: int, stop: threading.Event) -> None:
    last: tuple[float, int] | None = None
    while not stop.wait(PROGRESS_INTERVAL):
        try:
            with psycopg.connect(dsn, connect_timeout=5) as conn:
                backfill = store.get_backfill(conn, schema, backfill_id)
        except Exception as exc:  # noqa: BLE001 - progress is best effort
            log.warning("progress unavailable: %s", exc)
            continue
        now = time.monotonic()
        rate = None
        if last is not None and now > last[0]:
            rate = (backfill.rows_processed - last[1]) / (now - last[0])
        last = (now, backfill.rows_processed)
        log.info("backfill %d: %s", backfill_id, progress_line(backfill, rate))


def job_stopper(spark: Any, stopping: threading.Event, finished: threading.Event) -> Callable[[], None]:
    """How an app stops its backfill work (its supervisor gone, a signal): ``stopping`` set, and its
    Spark jobs cancelled, again until ``finished``, in case a job was being submitted just as the flag
    was set. The range tasks stop mid-page, their cursors where they were."""

    def stop() -> None:
        stopping.set()
        while not finished.is_set():
            try:
                spark.sparkContext.cancelAllJobs()
            except Exception:  # noqa: BLE001 - the context is stopping with the app
                return
            finished.wait(1.0)

    return stop


def run_backfill_app(
    config_path: str | None,
    backfill_id: int,
    master: str | None = None,
    ranges: int | None = None,
    max_page_rows: int = DEFAULT_MAX_PAGE_ROWS,
    window_timeout: float = DEFAULT_WINDOW_TIMEOUT,
) -> int:
    """The ``sequin_provider/spark_apps/backfill.py`` entry point; returns the process exit code (0: completed; 1: not
    completed: failed, cancelled, or stopped because its supervisor is gone; 2: bad input; 3: another
    app runs this backfill). Under a supervisor (``$SEQUIN_SUPERVISOR_PID``) the app stops once the
    supervisor is gone, leaving the backfill running for the supervisor's retry to resume."""
    from sequin_provider.spark.app import BACKFILL_JAVA_OPTIONS, spark_session, stop_when_supervisor_exits

    configure_logging()
    path = str(Path(config_path or os.environ.get("SEQUIN_CONFIG") or "sequin.yaml").absolute())
    try:
        load_config(path)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    spark = spark_session(f"sequin-backfill-{backfill_id}", master, BACKFILL_JAVA_OPTIONS)
    stopping, finished = threading.Event(), threading.Event()
    stop = job_stopper(spark, stopping, finished)
    stop_when_supervisor_exits(stop)
    try:
        final = run_backfill(spark, path, backfill_id, ranges, max_page_rows, window_timeout, stopping)
    except BackfillBusy as exc:
        log.error("%s", exc)
        return 3
    except (BackfillError, BackfillStopped) as exc:
        log.error("%s", exc)
        return 2
    finally:
        finished.set()
        spark.stop()
    return 0 if final.state == "completed" else 1


def active_backfills(config: SequinConfig, database: str) -> list[int]:
    """Ids of ``database``'s pending and running backfills, oldest first (running ones are resumed
    when their app is gone: their run lock tells). Those of a sink no longer in the config count as
    the store's database's: running one fails it with that reason."""
    sinks = {s.name: s.database for s in config.sinks}
    with psycopg.connect(config.store_dsn(database), connect_timeout=10) as conn:
        return sorted(
            b.id
            for b in store.list_backfills(conn, config.store.schema)
            if b.state in store.ACTIVE_BACKFILL_STATES and sinks.get(b.sink, database) == database
        )


def serve_backfills(
    spark: Any,
    config_path: str,
    databases: list[str],
    stopping: threading.Event,
    poll_interval: float = SERVE_POLL_INTERVAL,
    ranges: int | None = None,
    max_page_rows: int = DEFAULT_MAX_PAGE_ROWS,
    window_timeout: float = DEFAULT_WINDOW_TIMEOUT,
) -> None:
    """Run the backfills of ``databases`` as they are recorded, one at a time, until ``stopping``.

    A backfill another app runs is left to it (its run lock); one that cannot start (its table gone,
    its sink no longer configured) is marked failed with the reason, so it is not tried again; an
    error of one backfill never stops the server."""
    config = load_config(config_path)
    waker = BackfillWaker(config, databases)
    try:
        while not stopping.is_set():
            _serve_round(spark, config_path, config, databases, stopping, ranges, max_page_rows, window_timeout)
            waker.wait(poll_interval)
    finally:
        waker.close()


def _serve_round(
    spark: Any,
    config_path: str,
    config: SequinConfig,
    databases: list[str],
    stopping: threading.Event,
    ranges: int | None,
    max_page_rows: int,
    window_timeout: float,
) -> None:
    for database in databases:
        try:
            todo = active_backfills(config, database)
        except (psycopg.Error, BackfillError) as exc:
            log.warning("backfill server: the store of database %r is unavailable: %s", database, exc)
            continue
        for backfill_id in todo:
            if stopping.is_set():
                return
            _serve_one(
                spark, config_path, config, database, backfill_id, stopping, ranges, max_page_rows, window_timeout
            )


def prepare_range_worker(partition: Iterator[int]) -> Iterator[int]:
    """A warm-up task's body: import what a range task's first page would import, in the Python
    worker that will run it. That is the range reader; the destination kinds, which parsing the
    config loads; and pandas, which pyarrow imports at its first array conversion when pandas is
    installed (as PySpark's own Arrow support needs): 0.32 s, about 0.1 s for the kinds. Without
    this, the first page of each range of the server's first backfill paid both: 660-710 ms to
    render and stage against 200-280 for the pages after it (a 1,000,000-row backfill, two ranges)."""
    import pyarrow as pa

    import sequin_provider.backfill.reader  # noqa: F401 - the range task's own module
    from sequin_provider.sinks import registry

    registry.kinds()
    pa.array([0])  # pyarrow's first conversion: it imports pandas, when installed, to recognise its types
    yield sum(1 for _ in partition)


def warm_python_workers(spark: Any) -> None:
    """Start the server's Python workers (one task per core, each ``prepare_range_worker``), so its
    first backfill does not wait about a second for them as a one-off backfill app does, nor its
    first pages for imports."""
    started = time.monotonic()
    n = int(spark.sparkContext.defaultParallelism)
    spark.sparkContext.setJobDescription("sequin backfill server: start the Python workers")
    spark.sparkContext.parallelize(range(n), n).mapPartitions(prepare_range_worker).collect()
    log.info("backfill server: %d Python workers up in %.1fs", n, time.monotonic() - started)


class BackfillWaker:
    """Waits for the next look at the stores: a new backfill's ``NOTIFY`` (``store.BACKFILL_CHANNEL``)
    ends the wait at once, so a recorded backfill starts within milliseconds rather than a poll
    interval; the interval still bounds the wait (a lost connection, a backfill resumed by hand)."""

    def __init__(self, config: SequinConfig, databases: list[str]) -> None:
        self.config = config
        self.dsns = sorted({config.store_dsn(d) for d in databases})
        self.conn: psycopg.Connection[Any] | None = None

    def wait(self, timeout: float) -> None:
        """Until a backfill is recorded in one of the stores, or ``timeout`` seconds."""
        if len(self.dsns) != 1:  # several stores: no single connection hears them all
            time.sleep(timeout)
            return
        try:
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(self.dsns[0], autocommit=True, connect_timeout=10)
                self.conn.execute(f"LISTEN {store.BACKFILL_CHANNEL}")
            for _ in self.conn.notifies(timeout=timeout, stop_after=1):
                pass
        except psycopg.Error as exc:
            log.warning("backfill server: listening for new backfills failed (%s); polling instead", exc)
            self.close()
            time.sleep(timeout)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _serve_one(
    spark: Any,
    config_path: str,
    config: SequinConfig,
    database: str,
    backfill_id: int,
    stopping: threading.Event,
    ranges: int | None,
    max_page_rows: int,
    window_timeout: float,
) -> None:
    try:
        run_backfill(spark, config_path, backfill_id, ranges, max_page_rows, window_timeout, stopping, lock_wait=0)
    except BackfillBusy:
        log.debug("backfill %d is run by another app", backfill_id)
    except (BackfillError, BackfillStopped) as exc:
        log.error("backfill %d cannot run: %s", backfill_id, exc)
        try:
            with psycopg.connect(config.store_dsn(database), connect_timeout=10) as conn:
                store.transition_backfill(conn, config.store.schema, backfill_id, "failed", str(exc))
        except (psycopg.Error, BackfillError) as mark:
            log.warning("backfill %d could not be marked failed: %s", backfill_id, mark)
    except Exception:  # noqa: BLE001 - one backfill's trouble (a lost store connection) must not end the server
        log.exception("backfill %d: the server's run of it ended with an error; it is tried again", backfill_id)
        stopping.wait(SERVE_POLL_INTERVAL)


def run_backfill_server_app(
    config_path: str | None,
    database: str | None = None,
    master: str | None = None,
    poll_interval: float = SERVE_POLL_INTERVAL,
    ranges: int | None = None,
    max_page_rows: int = DEFAULT_MAX_PAGE_ROWS,
    window_timeout: float = DEFAULT_WINDOW_TIMEOUT,
) -> int:
    """``sequin backfill serve`` / ``spark_apps/backfill.py --serve``: the backfill server, until
    SIGTERM, SIGINT or its supervisor's exit; returns the exit code (0: stopped; 2: bad input;
    3: another server already serves one of the databases)."""
    from sequin_provider.metrics.backfill import BackfillMetrics
    from sequin_provider.metrics.core import serve_configured
    from sequin_provider.spark.app import BACKFILL_JAVA_OPTIONS, spark_session, stop_when_supervisor_exits

    configure_logging()
    path = str(Path(config_path or os.environ.get("SEQUIN_CONFIG") or "sequin.yaml").absolute())
    try:
        config = load_config(path)
        databases = [config.database(database).name] if database else [db.name for db in config.databases]
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    if poll_interval <= 0:
        log.error("--poll-interval must be positive, not %s", poll_interval)
        return 2
    locks = []
    try:
        for name in databases:
            lock = server_lock(
                config.store_dsn(name), config.store.schema, name, f"sequin-backfill-server pid {os.getpid()}"
            )
            if not lock.acquire():
                log.error("database %r already has a backfill server (%s)", name, lock.holder())
                return 3
            locks.append(lock)
        offset = [db.name for db in config.databases].index(databases[0]) if database else 0
        try:  # Prometheus /metrics on metrics.backfill_port (docs/metrics.md)
            metrics = serve_configured(config, "backfill", offset, BackfillMetrics(config, databases).registry)
        except ConfigError as exc:
            log.error("%s", exc)
            return 2
        spark = spark_session("sequin-backfill-server", master, BACKFILL_JAVA_OPTIONS)
        try:
            warm_python_workers(spark)
        except Exception as exc:  # noqa: BLE001 - only a head start: the first backfill starts them anyway
            log.warning("backfill server: the Python workers could not be started ahead: %s", _task_error(exc))
        stopping, finished = threading.Event(), threading.Event()
        stop = job_stopper(spark, stopping, finished)

        def on_signal(signum: int, _frame: Any) -> None:
            log.info("backfill server: signal %d, stopping", signum)
            threading.Thread(target=stop, daemon=True).start()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        stop_when_supervisor_exits(stop)
        log.info("backfill server up for database(s) %s: it runs each backfill as it is recorded", ", ".join(databases))
        try:
            serve_backfills(spark, path, databases, stopping, poll_interval, ranges, max_page_rows, window_timeout)
        finally:
            finished.set()
            spark.stop()
            if metrics is not None:
                metrics.close()
        log.info("backfill server stopped")
        return 0
    finally:
        for lock in locks:
            lock.release()
