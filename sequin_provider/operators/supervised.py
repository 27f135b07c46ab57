"""``SupervisedAppOperator``: what the two supervising operators share (DESIGN §6, §7, §10).

``SequinReplicationOperator`` (the stream app) and ``SequinBackfillServerOperator`` (the backfill
server) each keep one long-lived Spark app of a database running: they take a lock in the store
("one supervisor of this app per database"), submit the app with ``SparkSubmitHook``, and run
``supervision.Supervisor`` (restarts on exit or stall, bounded, exponential backoff) until the task
is stopped; ``on_kill`` stops the app cleanly. A subclass says which app, with which arguments, which
lock and sign of life, and which exits must not be restarted.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from sequin_provider.airflow_errors import airflow_errors
from sequin_provider.exceptions import LockHeldError
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.notifications.sequin import alert_from_environment
from sequin_provider.operators.common import load_sequin_config, optional_text, warn_if_elsewhere
from sequin_provider.operators.spark_submit import (
    SparkSubmitRun,
    SparkTarget,
    default_application,
    resolve_target,
    submit_conf,
    submit_env,
)
from sequin_provider.supervision import (
    AppRun,
    RestartPolicy,
    Supervisor,
    SupervisorLock,
    SupervisorStopped,
    never_fatal,
)

if TYPE_CHECKING:
    from pathlib import Path

    from airflow.sdk import Context

    from sequin_provider.config import DatabaseConfig


def supervisor_dag_defaults(alert_title: str) -> dict[str, Any]:
    """``default_args`` of a bundled ``@continuous`` DAG whose one task supervises an app: Airflow
    retries the failed supervisor (``SEQUIN_SUPERVISOR_RETRIES``, default 3, backing off from one
    minute to 30) and the last failure sends ``alert_title`` (``alert_from_environment``). Reads only
    the environment, so a DAG file may call it at parse time."""
    return {
        "retries": int(os.environ.get("SEQUIN_SUPERVISOR_RETRIES", "3")),
        "retry_delay": timedelta(minutes=1),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=30),
        "on_failure_callback": alert_from_environment(alert_title),
    }


class SupervisedAppOperator(BaseOperator):
    """Run and supervise one long-lived Spark app of a database until the task is stopped.

    :param database: the config's database (default: the only one).
    :param sequin_conn_id: the ``sequin`` connection (store for the lock and the sign of life; config path).
    :param spark_conn_id: the Spark connection.
    :param config_path: the ``sequin.yaml`` (default: the connection's, else ``SEQUIN_CONFIG``);
        spark-submit runs in its folder, so relative paths of the config resolve there.
    :param application: the app to submit (default: the installed package's file, ``app_file``;
        ``$SEQUIN_SPARK_APPS`` names another folder).
    :param stall_timeout: seconds without a new sign of life after which a running app counts as
        stalled (None or 0: only exits count).
    :param start_timeout: seconds a new app may take to show its first sign of life.
    :param max_restarts: consecutive restarts before the task fails.
    :param restart_backoff: delay before the first restart; doubles with each consecutive restart.
    :param max_restart_backoff: ceiling of that delay.
    :param reset_after: seconds of healthy running after which the restart count starts again at 0.
    :param stop_grace_period: seconds between SIGTERM and SIGKILL when stopping the app.
    :param poll_interval: seconds between two checks of the app and its sign of life.
    :param run_for: stop the app cleanly and succeed after this many seconds (tests, demos).
    :param spark_conf: extra ``--conf`` of spark-submit.
    :param env_vars: extra environment of spark-submit.
    :param driver_memory: ``--driver-memory`` (local mode holds the executors in the driver).
    """

    app_title: ClassVar[str] = "app"
    """The app in words: "the <app_title> of database 'x'"."""
    app_file: ClassVar[str] = ""
    """The app file of ``sequin_provider/spark_apps``."""
    submit_name: ClassVar[str] = "sequin"
    """spark-submit's ``--name`` prefix (the database is appended)."""

    template_fields: Sequence[str] = ("database", "sequin_conn_id", "spark_conn_id", "config_path", "application")

    def __init__(
        self,
        *,
        database: str | None = None,
        sequin_conn_id: str = SequinHook.default_conn_name,
        spark_conn_id: str = "spark_default",
        config_path: str | None = None,
        application: str | None = None,
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
        self.supervisor: Supervisor | None = None
        self._connections: dict[str, str] = {}  # {conn_id: DSN} the config names, handed to the app

    @cached_property
    def hook(self) -> SequinHook:
        """The ``sequin`` hook (built on first use, after templates are rendered)."""
        return SequinHook(self.sequin_conn_id)

    @property
    def runs(self) -> list[AppRun]:
        """Every run of the app this task started, in order."""
        return [] if self.supervisor is None else self.supervisor.runs

    @property
    def restarts(self) -> int:
        """Restarts so far."""
        return 0 if self.supervisor is None else self.supervisor.restarts

    @property
    def current_run(self) -> AppRun | None:
        """The app run being supervised (None between runs)."""
        return None if self.supervisor is None else self.supervisor.current

    # -- what a subclass says -----------------------------------------------------------------------

    def supervisor_lock(self, database: str, application_name: str) -> SupervisorLock:
        """The (not yet taken) lock "one supervisor of this app for ``database``"."""
        raise NotImplementedError

    def app_arguments(self, config_path: Path, database: str, target: SparkTarget) -> list[str]:
        """The app's arguments."""
        raise NotImplementedError

    def stall_timeout_for(self, db: DatabaseConfig) -> float:
        """The stall timeout to watch ``db``'s app with (0: only exits count)."""
        return float(self.stall_timeout or 0)

    def fatal(self, run: AppRun) -> str | None:
        """Why an exited run must not be restarted, or None (default: every exit is restarted)."""
        return never_fatal(run)

    def describe(self, database: str) -> str:
        """The app of ``database`` in words."""
        return f"the {self.app_title} of database {database!r}"

    # -- running it ----------------------------------------------------------------------------------

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
            lock = self.supervisor_lock(db.name, who)
            if not lock.acquire():
                raise LockHeldError(
                    f"{self.describe(db.name)} is already supervised: the advisory lock {lock.name!r} is held"
                    f" by {lock.holder()}"
                )
        try:
            self.supervisor = Supervisor(
                self.describe(db.name),
                lambda: self._launch(path, db.name),
                lock.read_heartbeat,
                self.policy(self.stall_timeout_for(db)),
                self.fatal,
            )
            with airflow_errors():
                try:
                    code = self.supervisor.run()
                except SupervisorStopped as exc:
                    raise AirflowException(str(exc)) from None
            return {"database": db.name, "restarts": self.supervisor.restarts, "exit_code": code}
        finally:
            lock.release()

    def policy(self, stall_timeout: float) -> RestartPolicy:
        """The operator's timeouts and restart budget."""
        return RestartPolicy(
            start_timeout=float(self.start_timeout),
            stall_timeout=stall_timeout,
            max_restarts=self.max_restarts,
            restart_backoff=self.restart_backoff,
            max_restart_backoff=self.max_restart_backoff,
            reset_after=self.reset_after,
            stop_grace_period=self.stop_grace_period,
            poll_interval=self.poll_interval,
            run_for=self.run_for,
        )

    def _launch(self, config_path: Path, database: str) -> SparkSubmitRun:
        """Submit the app for ``database`` through ``SparkSubmitHook``."""
        target = resolve_target(self.spark_conn_id)
        hook = SparkSubmitHook(
            conf=submit_conf(target, self.spark_conf),
            conn_id=self.spark_conn_id,
            application_args=self.app_arguments(config_path, database, target),
            env_vars=submit_env(target, self.env_vars, self._connections),
            name=f"{self.submit_name}-{database}",
            driver_memory=None if target.is_cluster else self.driver_memory,
        )
        application = self.application or default_application(self.app_file)
        return SparkSubmitRun(hook, application, cwd=str(config_path.parent)).start()

    def on_kill(self) -> None:
        """Stop the app cleanly (SIGTERM, SIGKILL after ``stop_grace_period``); the lock goes with the task.

        The app runs in a session of its own, so if Airflow kills the task process before the grace
        period is over, the app still finishes its clean stop (it already has the SIGTERM)."""
        if self.supervisor is not None:
            self.supervisor.stop()
