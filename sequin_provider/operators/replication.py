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

from typing import TYPE_CHECKING, Any, Sequence

from sequin_provider.operators.common import load_sequin_config, optional_text
from sequin_provider.operators.lineage import database_lineage
from sequin_provider.operators.supervised import SupervisedAppOperator
from sequin_provider.supervision import (
    HeartbeatWatch,
    StreamLock,
    backoff_delay,
    effective_stall_timeout,
    lock_name,
)

if TYPE_CHECKING:
    from pathlib import Path

    from sequin_provider.config import DatabaseConfig
    from sequin_provider.operators.spark_submit import SparkTarget

__all__ = ["HeartbeatWatch", "SequinReplicationOperator", "StreamLock", "backoff_delay", "lock_name"]
"""The supervision pieces stay importable from here (they live in ``sequin_provider.supervision``)."""


class SequinReplicationOperator(SupervisedAppOperator):
    """Run and supervise the stream app of one database until the task is stopped.

    The parameters are ``SupervisedAppOperator``'s (database, connections, timeouts, restart budget,
    ``run_for``, Spark settings), and:

    :param checkpoint: checkpoint folder (default: the config's ``stream.checkpoint_location/<db>``).

    ``stall_timeout`` counts seconds without a new heartbeat in ``stream_status``; keep it well above
    the database's ``heartbeat_interval``.
    """

    app_title = "stream app"
    app_file = "replication_stream.py"
    submit_name = "sequin-replication"
    template_fields: Sequence[str] = (*SupervisedAppOperator.template_fields, "checkpoint")
    ui_color = "#d5f5e3"

    def __init__(self, *, checkpoint: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def supervisor_lock(self, database: str, application_name: str) -> StreamLock:
        """The lock "one supervised stream app of ``database``"; its sign of life is the heartbeat."""
        return self.hook.stream_lock(database, application_name)

    def app_arguments(self, config_path: Path, database: str, target: SparkTarget) -> list[str]:
        """``--config``, ``--database``, ``--master`` and the checkpoint if given."""
        args = ["--config", str(config_path), "--database", database, "--master", target.master]
        if self.checkpoint:
            args += ["--checkpoint", str(self.checkpoint)]
        return args

    def stall_timeout_for(self, db: DatabaseConfig) -> float:
        """``effective_stall_timeout`` for the database's heartbeat interval (warns when it is too close)."""
        stall, warning = effective_stall_timeout(self.stall_timeout, db.heartbeat_interval)
        if warning:
            self.log.warning("database %r: %s", db.name, warning)
        return stall

    def get_openlineage_facets_on_start(self) -> Any:
        """OpenLineage (``apache-airflow-providers-openlineage``): every table the database's sinks
        capture in, every sink table out (``operators.lineage``); None if the config cannot be read."""
        try:
            config, _ = load_sequin_config(self.hook, self.config_path)
            db = config.database(optional_text(self.database))
        except Exception as exc:  # noqa: BLE001 - lineage must never fail the supervisor
            self.log.warning("no OpenLineage datasets: %s", exc)
            return None
        return database_lineage(config, db.name).operator_lineage()
