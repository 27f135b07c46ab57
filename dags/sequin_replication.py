"""``sequin_replication``: keep the stream app of a database running, supervised by Airflow.

``@continuous`` with one active run: the supervisor task runs as long as the app does; it restarts
the app when it exits or stalls (no new heartbeat in the store), and fails after repeated crashes,
so that the task's retries and the failure alert take over; when the run ends, the next one starts.
An advisory lock in the store keeps a second supervisor of the same database from starting an app.

Settings from the DAG processor's environment (read at parse time; no I/O): ``SEQUIN_DATABASE``
(default: the config's only database), ``SEQUIN_STALL_TIMEOUT`` (seconds, default 300),
``SEQUIN_MAX_RESTARTS`` (consecutive restarts before the task fails, default 5),
``SEQUIN_RESTART_BACKOFF`` (seconds before the first restart, doubling, default 10),
``SEQUIN_SUPERVISOR_RETRIES`` (Airflow retries of the failed task, default 3; the alert is sent
when the last one fails), ``SEQUIN_ALERT_WEBHOOK_URL`` (else the Variable
``sequin_alert_webhook_url``, read at run time).
Connections: ``sequin_default`` (store, ``config_path``) and ``spark_default`` (the master).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from airflow.sdk import dag

from sequin_provider.operators.replication import SequinReplicationOperator
from sequin_provider.operators.supervised import supervisor_dag_defaults


@dag(
    dag_id="sequin_replication",
    schedule="@continuous",
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["sequin"],
    doc_md=__doc__,
    default_args=supervisor_dag_defaults("Sequin stream app down"),
)
def sequin_replication() -> None:
    SequinReplicationOperator(
        task_id="supervise_stream",
        database=os.environ.get("SEQUIN_DATABASE") or None,
        stall_timeout=float(os.environ.get("SEQUIN_STALL_TIMEOUT", "300")),
        max_restarts=int(os.environ.get("SEQUIN_MAX_RESTARTS", "5")),
        restart_backoff=float(os.environ.get("SEQUIN_RESTART_BACKOFF", "10")),
    )


sequin_replication()
