"""``SequinBackfillOperator``: validate and record a backfill, run the ``backfill.py`` app through
``SparkSubmitHook``, and wait for the backfill to complete (DESIGN §7, §10).

The backfill's state in the store is the truth, not spark-submit's exit code: after the job returns
the operator reads it. ``completed`` returns the backfill id (XCom); ``failed``/``cancelled`` fail the
task with the backfill's error. Still active after spark-submit returned *successfully* means the
driver runs elsewhere (cluster deploy mode, fire-and-forget submission): the operator then waits on
the store, deferred to ``BackfillCompletedTrigger`` by default. Still active after spark-submit
*failed* means nobody is running it: the backfill is marked failed with the app's error, so that a
retry of the task can start a new one instead of finding the sink's table blocked.

With a backfill server up for the sink's database (``sequin backfill serve``, which holds
``backfill.server_lock``), the operator submits nothing: the server takes the backfill as it is
recorded, and the operator waits for it in the store as above.

A backfill records the task instance that asked for it. When a try dies without cleaning up (its
worker lost), the retry finds that backfill still active and resumes it from its cursors instead of
being refused. The Spark app holds the backfill's run lock while it runs and stops when its
supervisor is gone; if the lock is still held after ``takeover_wait`` (the app runs elsewhere, or
another run took it), the retry waits for that run in the store instead of starting a second one.
"""

from __future__ import annotations

import time
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from sequin_provider.airflow_errors import airflow_errors, airflow_exception
from sequin_provider.backfill import DEFAULT_MAX_QUERY_MS, RUN_LOCK_WAIT, progress_line
from sequin_provider.exceptions import SequinError
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.operators.assets import emit_sink_table_event, sink_table_asset, sink_tables_alias
from sequin_provider.operators.common import load_sequin_config, optional_text, task_instance_key, warn_if_elsewhere
from sequin_provider.operators.lineage import backfill_lineage
from sequin_provider.operators.spark_submit import (
    SparkSubmitRun,
    default_application,
    resolve_target,
    submit_conf,
    submit_env,
)
from sequin_provider.pgoutput import int_to_lsn
from sequin_provider.store import BackfillConflict
from sequin_provider.triggers.sequin import BACKFILL_FAILED_STATES, BackfillCompletedTrigger

if TYPE_CHECKING:
    from pathlib import Path

    from airflow.sdk import Context

    from sequin_provider.config import SequinConfig
    from sequin_provider.operators.lineage import Lineage
    from sequin_provider.store import Backfill

APPLICATION_NAME = "sequin-backfill-operator"

KINDS = ("full", "partial")
PROGRESS_LOG_INTERVAL = 30.0


class SequinBackfillOperator(BaseOperator):
    """Backfill ``table`` into ``sink``: every row (``kind="full"``), or rows with ``sort_column >=
    start_position`` (``kind="partial"``), as ``read`` messages, without racing the stream.

    The stream app of the sink's database must be running (it places the reads).

    :param sink: a sink of ``sequin.yaml``.
    :param table: one of the sink's tables (``schema.table``; ``public`` if no schema).
    :param kind: ``full`` or ``partial``; None: partial if ``sort_column`` is given.
    :param sort_column: partial backfills: the column to order and start by.
    :param start_position: partial backfills: the first value of ``sort_column`` (cast by Postgres).
    :param max_query_ms: time budget of one page query, 1-600000.
    :param where: only the rows matching this SQL condition over the table's columns, e.g.
        ``status = 'paid' AND region = 'eu'`` (checked by the source before anything is recorded;
        empty: every row). It runs on the source with the backfill's credentials: for operators.
    :param sequin_conn_id: the ``sequin`` connection (source, store, config path).
    :param spark_conn_id: the Spark connection (master ``local[*]``, ``spark://...``, ``yarn``, ...).
    :param config_path: the ``sequin.yaml`` (default: the connection's ``config_path`` extra, else
        ``SEQUIN_CONFIG``, else ``./sequin.yaml``); the Spark app reads the same file, and spark-submit
        runs in its folder (relative paths in it resolve there).
    :param application: the app to submit (default: the installed package's ``spark_apps/backfill.py``;
        ``$SEQUIN_SPARK_APPS`` names another folder).
    :param ranges: key ranges read in parallel (default: Spark's parallelism).
    :param max_page_rows: page size ceiling of the app.
    :param window_timeout: seconds the app waits for the stream app to take a page.
    :param spark_conf: extra ``--conf`` of spark-submit.
    :param env_vars: extra environment of spark-submit (override the Python defaults).
    :param driver_memory: spark-submit ``--driver-memory`` (local mode: executors live in the driver).
    :param deferrable: wait for a detached backfill in the triggerer (default) instead of a worker.
    :param poll_interval: seconds between two checks of the store while waiting.
    :param wait_timeout: seconds to wait for a detached backfill (None: no limit); the backfill is
        cancelled when it passes.
    :param takeover_wait: seconds a retry gives the app of an earlier try to stop (it stops once
        that try's process is gone) before waiting for that app instead of running the backfill.
    """

    template_fields: Sequence[str] = (
        "sink",
        "table",
        "kind",
        "sort_column",
        "start_position",
        "max_query_ms",
        "where",
        "sequin_conn_id",
        "spark_conn_id",
        "config_path",
        "application",
    )
    ui_color = "#d6eaf8"

    def __init__(
        self,
        *,
        sink: str,
        table: str,
        kind: str | None = None,
        sort_column: str | None = None,
        start_position: Any = None,
        max_query_ms: int | str = DEFAULT_MAX_QUERY_MS,
        where: str | None = None,
        sequin_conn_id: str = SequinHook.default_conn_name,
        spark_conn_id: str = "spark_default",
        config_path: str | None = None,
        application: str | None = None,
        ranges: int | None = None,
        max_page_rows: int | None = None,
        window_timeout: float | None = None,
        spark_conf: dict[str, Any] | None = None,
        env_vars: dict[str, Any] | None = None,
        driver_memory: str | None = "2g",
        deferrable: bool = True,
        poll_interval: float = 10.0,
        wait_timeout: float | None = None,
        takeover_wait: float = RUN_LOCK_WAIT,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("outlets", [sink_tables_alias()])  # the completed table's event goes through it
        super().__init__(**kwargs)
        self.sink = sink
        self.table = table
        self.kind = kind
        self.sort_column = sort_column
        self.start_position = start_position
        self.max_query_ms = max_query_ms
        self.where = where
        self.sequin_conn_id = sequin_conn_id
        self.spark_conn_id = spark_conn_id
        self.config_path = config_path
        self.application = application
        self.ranges = ranges
        self.max_page_rows = max_page_rows
        self.window_timeout = window_timeout
        self.spark_conf = spark_conf
        self.env_vars = env_vars
        self.driver_memory = driver_memory
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.wait_timeout = wait_timeout
        self.takeover_wait = takeover_wait
        self.backfill_id: int | None = None
        self.adopted = False  # the backfill was started by an earlier try of this task instance
        self._lineage: Lineage | None = None  # what the completed backfill read and wrote
        self._run: SparkSubmitRun | None = None

    @cached_property
    def hook(self) -> SequinHook:
        """The ``sequin`` hook (built on first use, after templates are rendered)."""
        return SequinHook(self.sequin_conn_id)

    # -- the request ---------------------------------------------------------------------------

    def request(self) -> dict[str, Any]:
        """The rendered parameters, checked: ``AirflowFailException`` names what is wrong."""
        sink, table = optional_text(self.sink), optional_text(self.table)
        sort_column, start_position = optional_text(self.sort_column), optional_text(self.start_position)
        kind = optional_text(self.kind) or ("partial" if sort_column else "full")
        if not sink or not table:
            raise AirflowFailException("a backfill needs a sink and a table")
        if kind not in KINDS:
            raise AirflowFailException(f"kind must be 'full' or 'partial', got {kind!r}")
        if kind == "full" and (sort_column or start_position):
            raise AirflowFailException("a full backfill takes no sort column or start position (use kind='partial')")
        if kind == "partial" and not (sort_column and start_position):
            raise AirflowFailException("a partial backfill needs a sort column and a start position")
        try:
            max_query_ms = int(str(self.max_query_ms).strip())
        except ValueError:
            raise AirflowFailException(f"max_query_ms must be an integer, got {self.max_query_ms!r}") from None
        with airflow_errors():
            SequinHook.check_max_query_ms(max_query_ms)
        return {
            "sink": sink,
            "table": table,
            "sort_column": sort_column,
            "start_position": start_position,
            "max_query_ms": max_query_ms,
            "where": optional_text(self.where),
        }

    def create(self, config: SequinConfig, request: dict[str, Any], requested_by: str | None = None) -> Backfill:
        """Validate against the source catalog and record the backfill (nothing recorded if invalid),
        or adopt the active one that an earlier try of this task instance (``requested_by``) started."""
        settings = self.hook.settings
        if config.has_sink(request["sink"]):
            sink = config.sink(request["sink"])
            warn_if_elsewhere(self.log, "source", settings.source_dsn, config.database(sink.database).dsn)
            warn_if_elsewhere(self.log, "store", settings.store_dsn, config.store_dsn(sink.database))
        try:
            return self.hook.create_backfill(
                config,
                request["sink"],
                request["table"],
                request["sort_column"],
                request["start_position"],
                request["max_query_ms"],
                requested_by,
                request["where"],
            )
        except BackfillConflict as exc:
            return self._adopt(exc, request, requested_by)
        except SequinError as exc:
            raise airflow_exception(exc) from exc

    def _adopt(self, conflict: BackfillConflict, request: dict[str, Any], requested_by: str | None) -> Backfill:
        """The active backfill of the sink's table, if an earlier try of this task started it with the same
        request; otherwise the conflict fails the task."""
        earlier = conflict.active
        if requested_by is None or earlier is None or earlier.requested_by != requested_by:
            raise AirflowFailException(str(conflict)) from None
        asked = {
            "sort_column": request["sort_column"],
            "start_position": request["start_position"],
            "max_query_ms": request["max_query_ms"],
            "where": request["where"],
        }
        differs = [f"{k} {getattr(earlier, k)!r} (now {v!r})" for k, v in asked.items() if getattr(earlier, k) != v]
        if differs:
            raise AirflowFailException(f"{conflict}; an earlier try of this task started it with " + ", ".join(differs))
        self.adopted = True
        self.log.info(
            "backfill %d was started by an earlier try of this task and is %s: resuming it from its cursors",
            earlier.id,
            earlier.state,
        )
        return earlier

    # -- running it ----------------------------------------------------------------------------

    def execute(self, context: Context) -> int:
        """Create the backfill, run the Spark app, then judge by the backfill's state."""
        request = self.request()
        config, path = load_sequin_config(self.hook, self.config_path)
        backfill = self.create(config, request, task_instance_key(context))
        self.backfill_id = backfill.id
        where = f" from {backfill.sort_column} >= {backfill.start_position!r}" if backfill.sort_column else ""
        where += f" where {backfill.where}" if backfill.where else ""
        self.log.info(
            "backfill %d: %s backfill of %s.%s for sink %r%s, about %s rows",
            backfill.id,
            backfill.kind,
            backfill.table_schema,
            backfill.table_name,
            backfill.sink,
            where,
            backfill.rows_initial if backfill.rows_initial is not None else "?",
        )
        if self._placed_elsewhere(config, backfill):
            return self.wait_in_store(backfill, context)
        try:
            self._run = self.submit(path, backfill.id, config.connections())
        except Exception as exc:
            self._transition("failed", f"the backfill app could not be submitted: {exc}")
            raise
        last_log = time.monotonic()
        while not self._run.wait(1.0):
            if time.monotonic() - last_log >= PROGRESS_LOG_INTERVAL:
                last_log = time.monotonic()
                self._log_progress()
        return self.after_run(self._run, context)

    def submit(
        self, config_path: Path, backfill_id: int, connections: Mapping[str, str] | None = None
    ) -> SparkSubmitRun:
        """Start the ``backfill.py`` app for ``backfill_id`` through ``SparkSubmitHook``; ``connections``
        (``{conn_id: DSN}`` the config names) reach it as ``AIRFLOW_CONN_*`` variables (``submit_env``)."""
        target = resolve_target(self.spark_conn_id)
        args = ["--config", str(config_path), "--backfill-id", str(backfill_id), "--master", target.master]
        for flag, value in (
            ("--ranges", self.ranges),
            ("--max-page-rows", self.max_page_rows),
            ("--window-timeout", self.window_timeout),
        ):
            if value is not None:
                args += [flag, str(value)]
        hook = SparkSubmitHook(
            conf=submit_conf(target, self.spark_conf),
            conn_id=self.spark_conn_id,
            application_args=args,
            env_vars=submit_env(target, self.env_vars, connections),
            name=f"sequin-backfill-{backfill_id}",
            driver_memory=None if target.is_cluster else self.driver_memory,
        )
        application = self.application or default_application("backfill.py")
        return SparkSubmitRun(hook, application, cwd=str(config_path.parent)).start()

    def after_run(self, run: SparkSubmitRun, context: Context | None = None) -> int:
        """spark-submit returned: completed -> id; failed/cancelled -> fail; still active -> wait or fail."""
        assert self.backfill_id is not None
        backfill = self.hook.backfill(self.backfill_id)
        self.log.info("backfill %d: %s", backfill.id, progress_line(backfill))
        if backfill.state == "completed":
            return self.completed(context, backfill.id)
        if backfill.state in BACKFILL_FAILED_STATES:
            raise AirflowException(f"backfill {backfill.id} {backfill.state}: {backfill.error or 'no error recorded'}")
        if not run.succeeded and not self._run_elsewhere(self.takeover_wait):
            reason = f"the backfill app stopped before the backfill finished ({run.failure()})"
            self._transition("failed", reason)
            raise AirflowException(f"backfill {backfill.id} failed: {reason}")
        # spark-submit returned at once while the app runs elsewhere (cluster deploy mode), or
        # another app holds the backfill (ours found it taken)
        return self.wait_in_store(backfill, context)

    def _run_elsewhere(self, wait: float) -> bool:
        """Whether another app holds the backfill's run lock after ``wait`` seconds (it is running it)."""
        assert self.backfill_id is not None
        with airflow_errors():
            holder = self.hook.backfill_run_by(self.backfill_id, wait, APPLICATION_NAME)
        if holder is not None:
            self.log.info("backfill %d is being run by another app (its lock is held by %s)", self.backfill_id, holder)
        return holder is not None

    def _placed_elsewhere(self, config: SequinConfig, backfill: Backfill) -> bool:
        """Whether the backfill runs without a Spark app of this task's (``backfill.place_backfill``): an
        earlier try's app still runs it (only asked when this try adopted it), or a backfill server
        (``sequin backfill serve``) is up for its database and takes it as it is recorded."""
        database = config.sink(backfill.sink).database
        with airflow_errors():
            placement = self.hook.place_backfill(
                database, backfill.id, self.takeover_wait if self.adopted else None, APPLICATION_NAME
            )
        if placement.where == "elsewhere":
            self.log.info(
                "backfill %d is being run by another app (its lock is held by %s)", backfill.id, placement.holder
            )
        elif placement.where == "server":
            self.log.info(
                "backfill %d goes to the backfill server of database %r (%s)", backfill.id, database, placement.holder
            )
        return placement.where != "here"

    def wait_in_store(self, backfill: Backfill, context: Context | None = None) -> int:
        """Wait for a backfill another process runs until the store says it finished: deferred to
        ``BackfillCompletedTrigger``, or in this worker (``deferrable=False``)."""
        self.log.info("backfill %d is %s: waiting for it in the store", backfill.id, backfill.state)
        end_time = None if self.wait_timeout is None else time.time() + float(self.wait_timeout)
        trigger = BackfillCompletedTrigger(
            backfill_id=backfill.id,
            sequin_conn_id=self.sequin_conn_id,
            poke_interval=self.poll_interval,
            end_time=end_time,
        )
        if self.deferrable:
            self.defer(
                trigger=trigger,
                method_name="execute_complete",
                timeout=None if self.wait_timeout is None else timedelta(seconds=float(self.wait_timeout)),
            )
        return self.execute_complete(context or {}, self._wait_in_worker(trigger))  # type: ignore[arg-type]

    def _wait_in_worker(self, trigger: BackfillCompletedTrigger) -> dict[str, Any]:
        """The trigger's loop, run here (``deferrable=False``)."""
        while True:
            try:
                observation = trigger.evaluate(trigger.measure(self.hook))
            except Exception as exc:  # noqa: BLE001 - SequinConditionError: failed/cancelled
                return {**getattr(exc, "payload", {}), "status": "error", "message": str(exc)}
            if observation.done:
                return observation.event("success")
            if trigger.end_time is not None and time.time() >= trigger.end_time:
                return observation.event("timeout")
            self.log.info("%s", observation.message)
            time.sleep(self.poll_interval)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> int:
        """Resume from ``BackfillCompletedTrigger``: the backfill id, or fail with its error."""
        backfill_id = int(event.get("backfill_id") or self.backfill_id or 0)
        self.backfill_id = backfill_id or self.backfill_id
        status, message = event.get("status"), str(event.get("message") or event)
        if status == "success":
            self.log.info("%s", message)
            return self.completed(context, backfill_id)
        if status == "timeout" and self.backfill_id is not None:
            self._transition("cancelled", f"the task stopped waiting: {message}")
        raise AirflowException(message)

    def completed(self, context: Context | None, backfill_id: int) -> int:
        """The backfill completed: emit the event of its sink table's asset (extra: rows, position, sink,
        ...; ``operators.assets``) and return its id. A failure to emit is logged, never fails the task
        (the backfill is done; a retry would not redo it)."""
        try:
            backfill = self.hook.backfill(backfill_id)
            config, _ = load_sequin_config(self.hook, self.config_path)
            database = config.sink(backfill.sink).database
            mark = self.hook.source_mark(config.database(database).dsn)
        except Exception as exc:  # noqa: BLE001 - see above
            self.log.warning("backfill %d completed; its asset event could not be made: %s", backfill_id, exc)
            return backfill_id
        table = f"{backfill.table_schema}.{backfill.table_name}"
        extra = {
            "event": "backfill_completed",
            "database": database,
            "sink": backfill.sink,
            "table": table,
            "backfill_id": backfill.id,
            "kind": backfill.kind,
            "rows": backfill.rows_processed,
            "rows_emitted": backfill.rows_emitted,
            "position": mark.lsn,
            "position_lsn": int_to_lsn(mark.lsn),
            "finished_at": backfill.finished_at.isoformat() if backfill.finished_at else None,
        }
        emit_sink_table_event(context, sink_table_asset(database, table, backfill.sink), extra)
        self._lineage = backfill_lineage(config, database, table, backfill.sink)
        return backfill_id

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage (``apache-airflow-providers-openlineage``): the source table read, the sink table written."""
        return None if self._lineage is None else self._lineage.operator_lineage()

    # -- stopping ------------------------------------------------------------------------------

    def on_kill(self) -> None:
        """Cancel the backfill (its tasks stop at their next page) and kill the Spark job."""
        if self.backfill_id is not None:
            self._transition("cancelled", "the Airflow task was killed")
        if self._run is not None:
            self._run.kill()

    def _transition(self, state: str, reason: str) -> None:
        """Best effort: move the backfill to a final state (it may already be in one)."""
        assert self.backfill_id is not None
        try:
            self.hook.transition_backfill(self.backfill_id, state, reason)  # the config's store (load_sequin_config)
            self.log.info("backfill %d: %s (%s)", self.backfill_id, state, reason)
        except SequinError as exc:
            self.log.warning("backfill %d not marked %s: %s", self.backfill_id, state, exc)

    def _log_progress(self) -> None:
        try:
            self.log.info("backfill %d: %s", self.backfill_id, self.hook.backfill_progress(int(self.backfill_id or 0)))
        except Exception as exc:  # noqa: BLE001 - progress is informational
            self.log.warning("backfill progress unavailable: %s", exc)
