"""The replication stream app: provision, then run the Structured Streaming query until stopped."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import psycopg

from sequin_provider import store
from sequin_provider.config import ConfigError, load_config
from sequin_provider.logs import configure_logging
from sequin_provider.metrics.core import serve_configured
from sequin_provider.provisioning import initialize
from sequin_provider.replication import ReplicationError

log = logging.getLogger("sequin.stream")


def _under_spark_submit() -> bool:
    """Whether spark-submit started this Python driver (its JVM hands the gateway over in the
    environment); its --master and --conf then rule and must not be overridden here."""
    return bool(os.environ.get("PYSPARK_GATEWAY_PORT")) or "spark.master" in os.environ.get("SPARK_SUBMIT_OPTS", "")


STREAM_JAVA_OPTIONS = "-XX:+UseParallelGC"
"""A stream app whose JVM evaluates Spark SQL over every change (``payload=full``: filters, custom
group columns): its generated code is hot, and the optimising JIT tier pays for itself."""
BACKFILL_JAVA_OPTIONS = "-XX:+UseParallelGC -XX:TieredStopAtLevel=1"
"""The backfill app's JVM only schedules Python tasks: the quick JIT tier alone saves it about 3 s
of CPU at start-up (7.6 -> 4.3-5.0 s, sampled per process during bench/backfill_throughput.py's
run (b); docs/architecture.md, "Measured refinements"), CPU the backfill's own databases share on small machines."""
SPOOL_STREAM_JAVA_OPTIONS = BACKFILL_JAVA_OPTIONS
"""A ``payload=spool`` stream app's JVM carries one row per spool slice and plans micro-batches:
no per-change code for the optimising tier to speed up, while compiling Spark's planning code
with it kept 2/3 of the JVM's CPU busy for minutes (300 compilations per batch after 10 batches).
Measured per thread under load (docs/architecture.md, "Measured refinements"): the JVM's CPU per change fell from 4.3-5.4
to 2.1-2.9 us in a young app and was 1.0-1.5 us after a minute of traffic (1.7-2.1 with both tiers)."""


def stream_java_options(payload: str) -> str:
    """The local driver JVM's options for a stream app whose source hands Spark ``payload``."""
    return SPOOL_STREAM_JAVA_OPTIONS if payload == "spool" else STREAM_JAVA_OPTIONS


TUNED_SPARK_CONF = {
    "spark.sql.execution.arrow.maxRecordsPerBatch": "20000",
    "spark.ui.showConsoleProgress": "false",  # bars of \r-joined text in the log; progress is logged
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
    "spark.python.unix.domain.socket.enabled": "true",
    "spark.broadcast.blockSize": "512k",
}
"""Spark settings the apps run with unless spark-submit's ``--conf`` (or spark-defaults) sets them.

``spark.python.unix.domain.socket.enabled``: the JVM talks to its Python workers (and the Python
driver) over Unix domain sockets instead of loopback TCP. Over TCP, a task's small writes to a
Python worker waited for the worker's delayed acknowledgement (Nagle's algorithm against Linux's
40 ms delayed ACK): measured at a steady 5,000 changes/s, the stream app's Python worker waited
43-50 ms for the first input of every task, and again as long for the partition its data source
read; with Unix sockets 2-3 ms. A micro-batch went from 190 to 90-100 ms (docs/performance.md).

``spark.broadcast.blockSize`` (Spark's default 4m): every job broadcasts its task binary, a few kB,
into a buffer of one block, allocated and zeroed whole: at 5,000 changes/s, 4 MB several times per
micro-batch, 31 % of all the JVM allocated (68 MB/s of 220), with young collections of 40-60 ms.
With 512k, in two runs each of ``bench/stream_throughput.py`` (2026-11-27): commit -> store latency
p50 86-90 -> 67-68 ms, p99 195-203 -> 129-134 ms, young collections more frequent and shorter (8 ms
on average); later runs put p99 within the machine's noise (docs/performance.md). Broadcasts of a
few MB (none of ours) take more blocks."""


def _submitted_conf() -> set[str]:
    """The Spark settings spark-submit (``--conf``, spark-defaults.conf) gave an already running
    driver JVM; empty when this process launches the JVM itself (the builder's settings are then
    the only ones)."""
    if not _under_spark_submit():
        return set()
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM; launches nothing
    return {key for key, _ in SparkConf().getAll()}


def shuffle_partitions(spark: Any) -> None:
    """Shuffles (a push sink's ``payload=full`` job, Spark SQL filters) as wide as the cores Spark
    has (at least 2) unless ``spark.sql.shuffle.partitions`` was given: Spark's default of 200
    would turn a micro-batch of a few hundred rows into 200 tasks."""
    if not spark.sparkContext.getConf().contains("spark.sql.shuffle.partitions"):
        spark.conf.set("spark.sql.shuffle.partitions", str(max(2, spark.sparkContext.defaultParallelism)))


def spark_session(app_name: str, master: str | None = None, java_options: str = STREAM_JAVA_OPTIONS) -> Any:
    """A SparkSession tuned for the stream app (small shuffles, quiet logs); ``java_options`` are the
    local driver JVM's unless ``$SEQUIN_SPARK_JAVA_OPTIONS`` says otherwise, with the class archive
    when there is one (``class_archive``: a faster start)."""
    from pyspark.sql import SparkSession

    from sequin_provider.spark.class_archive import archive_options
    from sequin_provider.spark.local_checkpoint import driver_classpath

    # executors' Python workers must run the interpreter that has this package (a venv's)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    elif not _under_spark_submit() and not os.environ.get("SPARK_MASTER"):
        builder = builder.config("spark.master", os.environ.get("SEQUIN_SPARK_MASTER", "local[2]"))
    # In local mode the driver JVM also runs the executors, which hold whole micro-batches.
    # (Under spark-submit the driver JVM already runs: its --driver-memory is what counts.)
    memory = os.environ.get("SEQUIN_SPARK_DRIVER_MEMORY", "4g")
    java_options = os.environ.get("SEQUIN_SPARK_JAVA_OPTIONS", java_options)
    builder = (
        builder.config("spark.driver.memory", memory)
        .config("spark.driver.extraJavaOptions", f"{java_options} {archive_options()}".strip())
        .config("spark.ui.enabled", os.environ.get("SEQUIN_SPARK_UI", "false"))
    )
    submitted = _submitted_conf()
    jar = driver_classpath()  # local_checkpoint's classes
    if jar and "spark.driver.extraClassPath" not in submitted:
        builder = builder.config("spark.driver.extraClassPath", jar)
    for key, value in TUNED_SPARK_CONF.items():
        if key not in submitted:
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    shuffle_partitions(spark)
    spark.sparkContext.setLogLevel(os.environ.get("SEQUIN_SPARK_LOG_LEVEL", "WARN"))
    return spark


SPOOL_PLAN_CONF = {"spark.sql.codegen.wholeStage": "false", "spark.sql.ui.explainMode": "simple"}
"""Session settings of a ``payload=spool`` stream app unless spark-submit gave them
(``plan_spool_batches_simply``)."""


def plan_spool_batches_simply(spark: Any, payload: str) -> None:
    """A ``payload=spool`` app's micro-batches carry one row per spool slice and run no Spark SQL
    over changes, yet Spark plans each one in full: whole-stage code generation compiles code that
    runs over a handful of rows, and each SQL execution renders its plan in the ``formatted`` form
    for the UI's event. At a steady rate these are paid per batch (docs/performance.md, "CPU at a
    steady rate"): such an app runs ``SPOOL_PLAN_CONF`` unless spark-submit set them. A
    ``payload=full`` app keeps Spark's defaults: its generated code runs over every change."""
    if payload != "spool":
        return
    given = spark.sparkContext.getConf()
    for key, value in SPOOL_PLAN_CONF.items():
        if not given.contains(key):
            spark.conf.set(key, value)


PROGRESS_POLL_INTERVAL = 1.0


def progress_since(query: Any, last: int | None) -> list[Any]:
    """Spark's progress reports (``StreamingQueryProgress``) of the micro-batches after batch ``last``
    (every one Spark keeps when None), oldest first, each rendered and parsed once.

    ``StreamingQuery.recentProgress`` renders every report Spark keeps (100 by default) as JSON in the
    JVM and parses each in Python, on every call: polled once a second while micro-batches ran 10-25
    a second, that was a fifth of the driver's CPU at a steady 5,000 changes/s, all thrown away but
    the few new ones. This walks Spark's list from its newest end through PySpark's handle on the
    JVM query (no public call takes part of the list), and falls back to ``recentProgress`` where
    there is no such handle (Spark Connect)."""
    from pyspark.sql.streaming.listener import StreamingQueryProgress

    jquery = getattr(query, "_jsq", None)
    if jquery is None:
        return [p for p in query.recentProgress if last is None or p.batchId > last]
    recent = jquery.recentProgress()
    found: list[Any] = []
    for i in range(len(recent) - 1, -1, -1):
        report = recent[i]
        if last is not None and report.batchId() <= last:
            break
        found.append(StreamingQueryProgress.fromJson(json.loads(report.json())))
    return found[::-1]


def log_progress(
    query: Any,
    done: threading.Event,
    interval: float = PROGRESS_POLL_INTERVAL,
    driver_changes: Callable[[int], int] = lambda _batch_id: 0,
) -> threading.Thread:
    """Log Spark's own phase timings per micro-batch with input (latestOffset = our read), polled
    from the query until ``done`` (``progress_since``); a batch the driver wrote
    (``Pipeline.driver_changes``: Spark counts no input rows for it) says so. Polled as JSON, not
    through a ``StreamingQueryListener``: PySpark hands a Python listener each event converted field
    by field over py4j, whose class lookups scan the JVM's classpath; measured under load, that was
    38 % of the stream app's JVM CPU."""

    def poll() -> None:
        last: int | None = None
        while not done.wait(interval):
            try:
                batches = progress_since(query, last)
            except Exception:  # noqa: BLE001 - the query is gone; the app is stopping
                return
            for progress in batches:
                by_driver = driver_changes(progress.batchId)
                if progress.numInputRows or by_driver:
                    durations = " ".join(f"{k}={v}" for k, v in sorted(progress.durationMs.items()))
                    written = f" (written by the driver: {by_driver} changes)" if by_driver else ""
                    log.info(
                        "progress batch %d: %d input rows, %s%s",
                        progress.batchId,
                        progress.numInputRows,
                        durations,
                        written,
                    )
            if batches:
                last = batches[-1].batchId

    thread = threading.Thread(target=poll, name="progress-log", daemon=True)
    thread.start()
    return thread


def run_stream_app(
    config_path: str | None, database: str | None, checkpoint: str | None, master: str | None = None
) -> int:
    """Run the stream app for one database; returns the process exit code."""
    configure_logging()
    try:
        path = str(Path(config_path or os.environ.get("SEQUIN_CONFIG") or "sequin.yaml").absolute())
        config = load_config(path)
        db = config.database(database)
        report = initialize(config, db.name)
    except (ConfigError, ReplicationError) as exc:
        log.error("%s", exc)
        return 2
    for line in report.created:
        log.info("created %s", line)
    for line in report.warnings:
        log.warning("%s", line)

    from sequin_provider.spark.local_checkpoint import use_local_checkpoint_manager
    from sequin_provider.spark.pipeline import Pipeline
    from sequin_provider.spark.source import SequinReplicationDataSource
    from sequin_provider.spark.spool import SpoolUnreachableError, check_reachable, join, spool_folder

    pipeline = Pipeline(config, db.name)
    spark = spark_session(f"sequin-replication-{db.name}", master, stream_java_options(pipeline.payload))
    spark.dataSource.register(SequinReplicationDataSource)
    plan_spool_batches_simply(spark, pipeline.payload)
    try:
        pipeline.validate(spark)
    except ConfigError as exc:
        log.error("%s", exc)
        spark.stop()
        return 2
    checkpoint_dir = checkpoint or join(config.stream.checkpoint_location, db.name)
    spool = spool_folder(config.stream.spool_location, checkpoint_dir, db.name)
    if not spark.sparkContext.master.startswith("local"):  # executors on other hosts read the spool
        try:
            check_reachable(spark, spool)
        except SpoolUnreachableError as exc:
            log.error("%s", exc)
            _record_error(config, db.name, str(exc))
            spark.stop()
            return 2
        log.info("spool %s: readable by the executors of %s", spool, spark.sparkContext.master)
    try:
        with psycopg.connect(config.store_dsn(db.name), connect_timeout=10) as conn:
            store.update_status(
                conn,
                config.store.schema,
                db.name,
                slot=db.slot.name,
                app_started_at=datetime.now(timezone.utc),
                last_error=None,
            )
    except psycopg.OperationalError as exc:
        log.error("cannot reach the store: %s", str(exc).strip())
        spark.stop()
        return 2

    try:  # Prometheus /metrics on metrics.stream_port (docs/metrics.md)
        metrics = serve_configured(config, "stream", config.databases.index(db), pipeline.metrics.registry)
    except ConfigError as exc:
        log.error("%s", exc)
        spark.stop()
        return 2
    use_local_checkpoint_manager(spark, checkpoint_dir)
    pipeline.write_small_batches(
        checkpoint_dir, spool, spark.sparkContext.master.startswith("local"), spark.sparkContext.defaultParallelism
    )
    changes = (
        spark.readStream.format("sequin_replication")
        .option("config", path)
        .option("database", db.name)
        .option("spool", spool)
        .option("partitions", str(spark.sparkContext.defaultParallelism))
        .option("payload", pipeline.payload)
        .load()
    )
    writer = changes.writeStream.foreachBatch(pipeline).option("checkpointLocation", checkpoint_dir)
    if config.stream.trigger_interval > 0:  # else Spark's default: each batch as soon as the last one ends
        writer = writer.trigger(processingTime=f"{round(config.stream.trigger_interval * 1000)} milliseconds")
    query = writer.queryName(f"sequin_{db.name}").start()
    stopping, finished = threading.Event(), threading.Event()
    log_progress(query, finished, driver_changes=pipeline.driver_changes)

    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping the stream query", signum)
        stopping.set()
        threading.Thread(target=query.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stop_when_supervisor_exits(lambda: stop(signal.SIGTERM, None))
    log.info(
        "streaming database %r from slot %r (checkpoint %s%s)",
        db.name,
        db.slot.name,
        checkpoint_dir,
        f"; micro-batches at most every {config.stream.trigger_interval:g}s" if config.stream.trigger_interval else "",
    )
    try:
        query.awaitTermination()
    except Exception as exc:  # noqa: BLE001 - StreamingQueryException carries the batch's error
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.error("stream query failed: %s", message)
        _record_error(config, db.name, message)
        return 1
    finally:
        finished.set()
        pipeline.close()
        if metrics is not None:
            metrics.close()
        spark.stop()
    return 0 if stopping.is_set() else 1


SUPERVISOR_PID_ENV = "SEQUIN_SUPERVISOR_PID"
SUPERVISOR_CHECK_INTERVAL = 2.0


def stop_when_supervisor_exits(stop: Callable[[], None], interval: float = SUPERVISOR_CHECK_INTERVAL) -> None:
    """Stop the app (as SIGTERM would) once the process in ``$SEQUIN_SUPERVISOR_PID`` is gone.

    The supervising task starts the app in a session of its own, so that stopping the app stops
    the whole spark-submit tree; the price is that the app outlives a supervisor that is killed
    without running ``on_kill`` (a worker lost, Airflow stopped hard). An orphaned app would hold
    the slot and keep the next supervisor from starting one, so the app watches for that itself.
    """
    value = os.environ.get(SUPERVISOR_PID_ENV)
    if not value:
        return
    try:
        pid = int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not a process id", SUPERVISOR_PID_ENV, value)
        return

    def watch() -> None:
        while True:
            time.sleep(interval)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                log.warning("the supervisor (pid %d) is gone: stopping", pid)
                stop()
                return
            except PermissionError:  # alive, owned by another user
                pass

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def _record_error(config: Any, database: str, message: str) -> None:
    try:
        with psycopg.connect(config.store_dsn(database), connect_timeout=5) as conn:
            store.update_status(conn, config.store.schema, database, last_error=message[:2000])
    except Exception:  # noqa: BLE001 - the store may be the reason we failed
        pass
