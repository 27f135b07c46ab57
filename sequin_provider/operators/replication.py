"""``SequinReplicationOperator``: run the long-lived stream app and keep it alive (DESIGN §6, §10).

The app is submitted with ``SparkSubmitHook`` (``sequin_provider/spark_apps/replication_stream.py``,
found in the installed package), like every Spark app of the product, so the same operator drives
``local[*]``, a standalone cluster or YARN. Locally, ``python -m sequin_provider.spark_apps.replication_stream``
would save the spark-submit JVM's start-up, but the supervisor would then not be what runs in production;
stopping stays clean under spark-submit because the SIGTERM goes to the Python driver (see ``spark_submit``).

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
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from sequin_provider.airflow_errors import airflow_errors
from sequin_provider.exceptions import LockHeldError, SupervisionError
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.operators.common import load_sequin_config, optional_text, warn_if_elsewhere
from sequin_provider.operators.spark_submit import SparkSubmitRun, default_application, resolve_target, submit_env
from sequin_provider.supervision import (
    HeartbeatWatch,
    RestartBudget,
    StreamLock,
    backoff_delay,
    effective_stall_timeout,
    lock_name,
)

if TYPE_CHECKING:
    from datetime import datetime
    from pathlib import Path

    from airflow.sdk import Context

__all__ = ["HeartbeatWatch", "SequinReplicationOperator", "StreamLock", "backoff_delay", "lock_name"]
"""The supervision pieces stay importable from here (they live in ``sequin_provider.supervision``)."""


class SequinReplicationOperator(BaseOperator):
    """Run and supervise the stream app of one database until the task is stopped.

    :param database: the config's database (default: the only one).
    :param sequin_conn_id: the ``sequin`` connection (store for the heartbeat and the lock; config path).
    :param spark_conn_id: the Spark connection.
    :param config_path: the ``sequin.yaml`` (default: the connection's, else ``SEQUIN_CONFIG``);
        spark-submit runs in its folder, so a relative ``checkpoint_location`` resolves there.
    :param application: the app to submit (default: the installed package's
        ``spark_apps/replication_stream.py``; ``$SEQUIN_SPARK_APPS`` names another folder).
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

    template_fields: Sequence[str] = (
        "database",
        "sequin_conn_id",
        "spark_conn_id",
        "config_path",
        "application",
        "checkpoint",
    )
    ui_color = "#d5f5e3"

    def __init__(
        self,
        *,
        database: str | None = None,
        sequin_conn_id: str = SequinHook.default_conn_name,
        spark_conn_id: str = "spark_default",
        config_path: str | None = None,
        application: str | None = None,
        checkpoint: str | None = None,
        stall_timeout: float | None = 300.0,
        start_timeout: float = 600.0,
        max_restarts: int = 5,
        restart_backoff: float = 10.0,
        max_restart_backoff: float = 300.0,
        reset_after: float = 600.0,
        stop_grace_period: float = 60.0,
        poll_interval: float = 5.0,
        run_for: float | None = None,
        spark_conf: dict[str, Any] | None = None,
        env_vars: dict[str, Any] | None = None,
        driver_memory: str | None = "4g",
        **kwargs: Any,
    ) -> None:
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
        self._connections: dict[str, str] = {}  # {conn_id: DSN} the config names, handed to the app

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
        self._connections = config.connections()
        with airflow_errors():
            db = config.database(optional_text(self.database))
        warn_if_elsewhere(self.log, "store", self.hook.settings.store_dsn, config.store_dsn(db.name))
        ti = context.get("ti") if context else None
        who = f"sequin-supervisor {getattr(ti, 'dag_id', '')}.{getattr(ti, 'task_id', self.task_id)}"
        with airflow_errors():
            self.hook.migrate_store()
            lock = self.hook.stream_lock(db.name, who)
            if not lock.acquire():
                raise LockHeldError(
                    f"the stream app of database {db.name!r} is already supervised: the advisory"
                    f" lock {lock_name(lock.schema, db.name)!r} is held by {lock.holder()}"
                )
        self._lock = lock
        stall, warning = effective_stall_timeout(self.stall_timeout, db.heartbeat_interval)
        if warning:
            self.log.warning("database %r: %s", db.name, warning)
        try:
            with airflow_errors():
                return self._supervise(path, db.name, stall)
        finally:
            if self._run is not None:
                self._run.stop(self.stop_grace_period)
                self._run = None
            lock.release()
            self._lock = None

    def _supervise(self, config_path: Path, database: str, stall_timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        budget = RestartBudget(self.max_restarts, self.restart_backoff, self.max_restart_backoff, self.reset_after)
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
                        reason = watch.stall_reason(now)
                        run.stop(self.stop_grace_period)
                if reason is None and self._stop.wait(self.poll_interval):
                    self._check_stopped()
            self._run = None
            self._check_stopped()
            delay = budget.next_delay(watch.healthy_for(time.monotonic()))
            if delay is None:
                raise SupervisionError(
                    f"the stream app of database {database!r} {reason}; giving up after"
                    f" {self.max_restarts} consecutive restarts"
                )
            self.restarts += 1
            self.log.warning(
                "the stream app of database %r %s; restart %d/%d in %.1fs",
                database,
                reason,
                budget.consecutive,
                self.max_restarts,
                delay,
            )
            if self._stop.wait(delay):
                self._check_stopped()

    def _launch(self, config_path: Path, database: str) -> SparkSubmitRun:
        """Submit the ``replication_stream.py`` app for ``database`` through ``SparkSubmitHook``."""
        target = resolve_target(self.spark_conn_id)
        args = ["--config", str(config_path), "--database", database, "--master", target.master]
        if self.checkpoint:
            args += ["--checkpoint", str(self.checkpoint)]
        hook = SparkSubmitHook(
            conf=self.spark_conf,
            conn_id=self.spark_conn_id,
            application_args=args,
            env_vars=submit_env(target, self.env_vars, self._connections),
            name=f"sequin-replication-{database}",
            driver_memory=None if target.is_cluster else self.driver_memory,
        )
        application = self.application or default_application("replication_stream.py")
        return SparkSubmitRun(hook, application, cwd=str(config_path.parent)).start()

    def _read_heartbeat(self) -> datetime | None:
        """The heartbeat, on the lock's connection; a lost connection is re-locked (or the task fails)."""
        assert self._lock is not None
        return self._lock.read_heartbeat()

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
