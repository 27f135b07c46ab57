"""``sequin_backfill_server``: keep the backfill server of a database running, supervised by Airflow.

The backfill server (``sequin backfill serve``) keeps one Spark app up and runs each backfill of its
database as it is recorded, so a backfill started from ``sequin_backfill`` (or ``sequin backfill
start``) pays no Spark start: while the server is up, ``SequinBackfillOperator`` submits nothing and
waits for the server's run in the store (deferred).

``@continuous`` with one active run, like ``sequin_replication``: the supervisor task runs as long
as the server does; it restarts the server when it exits or loses its lock in the store, and fails
after repeated crashes (or at once when another server serves the database), so that the task's
retries and the failure alert take over. An advisory lock in the store keeps a second supervisor of
the same database from starting a server.

Settings from the DAG processor's environment (read at parse time; no I/O): ``SEQUIN_DATABASE``
(default: the config's only database), ``SEQUIN_BACKFILL_SERVER_STALL_TIMEOUT`` (seconds without
the server's lock held before a restart, default 300), ``SEQUIN_MAX_RESTARTS`` (default 5),
``SEQUIN_RESTART_BACKOFF`` (seconds, doubling, default 10), ``SEQUIN_SUPERVISOR_RETRIES`` (default 3),
``SEQUIN_BACKFILL_SERVER_DRIVER_MEMORY`` (``--driver-memory``, default ``4g``),
``SEQUIN_ALERT_WEBHOOK_URL`` (else the Variable ``sequin_alert_webhook_url``, read at run time).
Connections: ``sequin_default`` (store, ``config_path``) and ``spark_default`` (the master).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from airflow.sdk import dag

from sequin_provider.operators.backfill_server import SequinBackfillServerOperator
from sequin_provider.operators.supervised import supervisor_dag_defaults


@dag(
    dag_id="sequin_backfill_server",
    schedule="@continuous",
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["sequin"],
    doc_md=__doc__,
    default_args=supervisor_dag_defaults("Sequin backfill server down"),
)
def sequin_backfill_server() -> None:
    SequinBackfillServerOperator(
        task_id="supervise_backfill_server",
        database=os.environ.get("SEQUIN_DATABASE") or None,
        stall_timeout=float(os.environ.get("SEQUIN_BACKFILL_SERVER_STALL_TIMEOUT", "300")),
        max_restarts=int(os.environ.get("SEQUIN_MAX_RESTARTS", "5")),
        restart_backoff=float(os.environ.get("SEQUIN_RESTART_BACKOFF", "10")),
        driver_memory=os.environ.get("SEQUIN_BACKFILL_SERVER_DRIVER_MEMORY", "4g"),
    )


sequin_backfill_server()
