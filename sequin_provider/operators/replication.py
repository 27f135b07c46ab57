"""``SequinReplicationOperator``: run the long-lived stream app and keep it alive (DESIGN §6, §10).

The app is submitted with ``SparkSubmitHook`` (``spark_apps/replication_stream.py``), like every Spark
app of the product, so the same operator drives ``local[*]``, a standalone cluster or YARN. Locally,
``python spark_apps/replication_stream.py`` would save the spark-submit JVM's start-up, but the
supervisor would then not be what runs in production; stopping stays clean under spark-submit
because the SIGTERM goes to the Python driver (see ``spark_submit``).

While the app runs the operator watches ``<store>.stream_status.heartbeat_at`` of its database. The
heartbeat is judged by *change*, on this worker's monotonic clock (no clock skew with the driver):
the app is stalled when no new heartbeat arrived within ``start_timeout`` of its start, or within
``stall_timeout`` of the previous one. An exited or stalled app is restarted after an exponential
backoff; after ``max_restarts`` consecutive restarts the task fails, and Airflow's retries and
failure callbacks take over. A run that stayed healthy for ``reset_after`` seconds resets the count.

At most one supervised app per database: the operator holds a session-level advisory lock in the
store for as long as it supervises, on a connection of its own; a second task instance fails at
once, naming the holder. (The replication slot is a second line of defence: Postgres lets one
consumer stream from a slot at a time.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

import psycopg

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from sequin_provider import store
from sequin_provider.config import ConfigError
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.operators.common import load_sequin_config, optional_text, warn_if_elsewhere
from sequin_provider.operators.spark_submit import SparkSubmitRun, default_application, resolve_target, submit_env
from sequin_provider.session_lock import SessionLock

if TYPE_CHECKING:
    from pathlib import Path

    from airflow.sdk import Context


def lock_name(schema: str, database: str) -> str:
    """Text of the advisory lock of a database's stream app (hashed by ``hashtext``)."""
    return f"sequin-stream:{schema}:{database}"


class StreamLock(SessionLock):
    """The advisory lock "one supervised stream app per database", held by its own connection."""

    def __init__(self, dsn: str, schema: str, database: str, application_name: str = "sequin-supervisor") -> None:
        super().__init__(dsn, lock_name(schema, database), application_name)
        self.schema = schema
        self.database = database

    def heartbeat(self) -> datetime | None:
        """``stream_status.heartbeat_at`` of the database, read on the lock's connection (which also
        proves the lock is still held). Raises ``psycopg.OperationalError`` if the connection is lost."""
        assert self.conn is not None
        rows = [r for r in store.read_status(self.conn, self.schema) if r["database"] == self.database]
        return rows[0]["heartbeat_at"] if rows else None


@dataclass
class HeartbeatWatch:
    """Stall detection of one app run, by change of the heartbeat on the supervisor's own clock.

    :param started: monotonic time the run started.
    :param baseline: the heartbeat recorded before the run (a previous run's): not a sign of life.
    """

    start_timeout: float
    stall_timeout: float
    started: float
    baseline: Any = None
    last_value: Any = field(init=False, default=None)
    first_beat: float | None = field(init=False, default=None)
    last_beat: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.last_value = self.baseline

    def observe(self, value: Any, now: float) -> None:
        """Record a reading of the heartbeat (None: no reading, e.g. the store was unreachable)."""
        if value is not None and value != self.last_value:
            self.last_value = value
            self.last_beat = now
            if self.first_beat is None:
                self.first_beat = now

    def stalled(self, now: float) -> bool:
        """No first heartbeat within ``start_timeout``, or none for ``stall_timeout`` since the last."""
        if self.last_beat is None:
            return now - self.started > self.start_timeout
        return now - self.last_beat > self.stall_timeout

    def healthy_for(self, now: float) -> float:
        """Seconds since the run's first heartbeat (0 if none)."""
        return 0.0 if self.first_beat is None else now - self.first_beat


def backoff_delay(restart: int, initial: float, maximum: float) -> float:
    """Delay before restart number ``restart`` (1-based): ``initial`` doubling, capped at ``maximum``."""
    return min(float(initial) * 2 ** max(restart - 1, 0), float(maximum))


class SequinReplicationOperator(BaseOperator):
    """Run and supervise the stream app of one database until the task is stopped.

    :param database: the config's database (default: the only one).
    :param sequin_conn_id: the ``sequin`` connection (store for the heartbeat and the lock; config path).
    :param spark_conn_id: the Spark connection.
    :param config_path: the ``sequin.yaml`` (default: the connection's, else ``SEQUIN_CONFIG``);
        spark-submit runs in its folder, so a relative ``checkpoint_location`` resolves there.
    :param application: the app to submit (default ``spark_apps/replication_stream.py``).
    :param checkpoint: checkpoint folder (default: the config's ``stream.checkpoint_location/<db>``).
    :param stall_timeout: seconds without a new heartbeat after which a running app counts as stalled
        (None or 0: only exits count); keep it well above the database's ``heartbeat_interval``.
    :param start_timeout: seconds a new app may take to record its first heartbeat.
    :param max_restarts: consecutive restarts before the task fails.
    :param restart_backoff: delay before the first restart; doubles with each consecutive restart.
    :param max_restart_backoff: ceiling of that delay.
    :param reset_after: seconds of healthy running after which the restart count starts again at 0.
    :param stop_grace_period: seconds between SIGTERM and SIGKILL when stopping the app.
    :param poll_interval: seconds between two checks of the app and its heartbeat.
    :param run_for: stop the app cleanly and succeed after this many seconds (tests, demos).
    :param spark_conf: extra ``--conf`` of spark-submit.
    :param env_vars: extra environment of spark-submit.
    :param driver_memory: ``--driver-memory`` (local mode holds whole micro-batches in the driver).
    """

    template_fields: Sequence[str] = ("database", "sequin_conn_id", "spark_conn_id", "config_path", "application",
                                      "checkpoint")
    ui_color = "#d5f5e3"

    def __init__(self, *, database: str | None = None, sequin_conn_id: str = SequinHook.default_conn_name,
                 spark_conn_id: str = "spark_default", config_path: str | None = None,
                 application: str | None = None, checkpoint: str | None = None,
                 stall_timeout: float | None = 300.0, start_timeout: float = 600.0, max_restarts: int = 5,
                 restart_backoff: float = 10.0, max_restart_backoff: float = 300.0, reset_after: float = 600.0,
                 stop_grace_period: float = 60.0, poll_interval: float = 5.0, run_for: float | None = None,
                 spark_conf: dict[str, Any] | None = None, env_vars: dict[str, Any] | None = None,
                 driver_memory: str | None = "4g", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.database = database
        self.sequin_conn_id = sequin_conn_id
        self.spark_conn_id = spark_conn_id
        self.config_path = config_path
        self.application = application
        self.checkpoint = checkpoint
        self.stall_timeout = stall_timeout
        self.start_timeout = start_timeout
        self.max_restarts = max_restarts
        self.restart_backoff = restart_backoff
        self.max_restart_backoff = max_restart_backoff
        self.reset_after = reset_after
        self.stop_grace_period = stop_grace_period
        self.poll_interval = poll_interval
        self.run_for = run_for
        self.spark_conf = spark_conf
        self.env_vars = env_vars
        self.driver_memory = driver_memory
        self.restarts = 0
        self.runs: list[SparkSubmitRun] = []
        self._run: SparkSubmitRun | None = None
        self._stop = threading.Event()
        self._lock: StreamLock | None = None

    @cached_property
    def hook(self) -> SequinHook:
        """The ``sequin`` hook (built on first use, after templates are rendered)."""
        return SequinHook(self.sequin_conn_id)

    @property
    def current_run(self) -> SparkSubmitRun | None:
        """The app run being supervised (None between runs)."""
        return self._run

    def execute(self, context: Context) -> dict[str, Any]:
        """Take the lock, then run, watch and restart the app until stopped or out of restarts."""
        config, path = load_sequin_config(self.hook, self.config_path)
        try:
            db = config.database(optional_text(self.database))
        except ConfigError as exc:
            raise AirflowFailException(str(exc)) from None
        settings = self.hook.settings
        warn_if_elsewhere(self.log, "store", settings.store_dsn, config.store_dsn(db.name))
        ti = context.get("ti") if context else None
        who = f"sequin-supervisor {getattr(ti, 'dag_id', '')}.{getattr(ti, 'task_id', self.task_id)}"
        lock = StreamLock(settings.store_dsn, settings.store_schema, db.name, who)
        with psycopg.connect(settings.store_dsn, connect_timeout=10) as conn:
            store.migrate(conn, settings.store_schema)
        if not lock.acquire():
            raise AirflowFailException(f"the stream app of database {db.name!r} is already supervised: the advisory"
                                       f" lock {lock_name(settings.store_schema, db.name)!r} is held by"
                                       f" {lock.holder()}")
        self._lock = lock
        stall = float(self.stall_timeout or 0)
        if stall and db.heartbeat_interval <= 0:
            self.log.warning("database %r has heartbeat_interval 0: an idle stream records no heartbeats, so only"
                             " exits of the app are watched", db.name)
            stall = 0.0
        elif stall and stall < 3 * db.heartbeat_interval:
            self.log.warning("stall_timeout %.0fs is close to heartbeat_interval %.0fs: an idle but healthy app may be"
                             " restarted", stall, db.heartbeat_interval)
        try:
            return self._supervise(path, db.name, stall)
        finally:
            if self._run is not None:
                self._run.stop(self.stop_grace_period)
                self._run = None
            lock.release()
            self._lock = None

    def _supervise(self, config_path: Path, database: str, stall_timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        consecutive = 0
        while True:
            self._check_stopped()
            assert self._lock is not None
            watch = HeartbeatWatch(float(self.start_timeout), stall_timeout, time.monotonic(), self._read_heartbeat())
            self._run = run = self._launch(config_path, database)
            self.runs.append(run)
            self.log.info("stream app of database %r started (spark-submit pid %s)", database, run.pid)
            reason = None
            while reason is None:
                now = time.monotonic()
                if run.finished:
                    reason = "exited with 0 (stopped from outside)" if run.succeeded else f"exited ({run.failure()})"
                    run.kill()  # whatever it left behind in its process group
                elif self.run_for is not None and now - started >= float(self.run_for):
                    self.log.info("run_for %.0fs reached: stopping the stream app of %r", float(self.run_for), database)
                    code = run.stop(self.stop_grace_period)
                    self._run = None
                    return {"database": database, "restarts": self.restarts, "exit_code": code}
                else:
                    watch.observe(self._read_heartbeat(), now)
                    if stall_timeout and watch.stalled(now):
                        waited = "first" if watch.last_beat is None else "new"
                        reason = f"stalled (no {waited} heartbeat for {now - (watch.last_beat or watch.started):.0f}s)"
                        run.stop(self.stop_grace_period)
                if reason is None and self._stop.wait(self.poll_interval):
                    self._check_stopped()
            self._run = None
            self._check_stopped()
            if watch.healthy_for(time.monotonic()) >= self.reset_after:
                consecutive = 0
            consecutive += 1
            if consecutive > self.max_restarts:
                raise AirflowException(f"the stream app of database {database!r} {reason}; giving up after"
                                       f" {self.max_restarts} consecutive restarts")
            delay = backoff_delay(consecutive, self.restart_backoff, self.max_restart_backoff)
            self.restarts += 1
            self.log.warning("the stream app of database %r %s; restart %d/%d in %.1fs", database, reason, consecutive,
                             self.max_restarts, delay)
            if self._stop.wait(delay):
                self._check_stopped()

    def _launch(self, config_path: Path, database: str) -> SparkSubmitRun:
        """Submit ``spark_apps/replication_stream.py`` for ``database`` through ``SparkSubmitHook``."""
        target = resolve_target(self.spark_conn_id)
        args = ["--config", str(config_path), "--database", database, "--master", target.master]
        if self.checkpoint:
            args += ["--checkpoint", str(self.checkpoint)]
        hook = SparkSubmitHook(conf=self.spark_conf, conn_id=self.spark_conn_id, application_args=args,
                               env_vars=submit_env(target, self.env_vars), name=f"sequin-replication-{database}",
                               driver_memory=None if target.is_cluster else self.driver_memory)
        application = self.application or default_application("replication_stream.py")
        return SparkSubmitRun(hook, application, cwd=str(config_path.parent)).start()

    def _read_heartbeat(self) -> datetime | None:
        """The heartbeat, on the lock's connection; a lost connection is re-locked (or the task fails)."""
        assert self._lock is not None
        try:
            if self._lock.conn is None and not self._lock.acquire():
                raise AirflowException(f"lost the advisory lock of database {self._lock.database!r} and another"
                                       f" session took it ({self._lock.holder()}): stopping this supervisor")
            return self._lock.heartbeat()
        except psycopg.Error as exc:
            self.log.warning("store unreachable, heartbeat not checked: %s", str(exc).strip())
            self._lock.release()
            return None

    def _check_stopped(self) -> None:
        if self._stop.is_set():
            raise AirflowException("the supervisor was stopped (on_kill): the stream app was stopped")

    def on_kill(self) -> None:
        """Stop the app cleanly (SIGTERM, SIGKILL after ``stop_grace_period``); the lock goes with the task.

        The app runs in a session of its own, so if Airflow kills the task process before the grace
        period is over, the app still finishes its clean stop (it already has the SIGTERM)."""
        self._stop.set()
        run = self._run
        if run is not None:
            run.stop(self.stop_grace_period)
