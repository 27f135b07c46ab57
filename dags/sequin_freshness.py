"""``sequin_freshness``: tell Airflow, every few minutes, through which commit time each sink table is delivered.

Every sink table is an Asset, ``sequin://<database>/<schema>.<table>?sink=<sink>`` (docs/assets.md).
Each run takes a mark on each source database (the source's clock and a WAL position every
transaction committed by then precedes), waits for the stream to confirm it, and emits an event of
every table of every sink with nothing parked before it, with the extra ``complete_through`` (ISO
8601): every change committed at or before it has reached the sink. A DAG scheduled on such an asset
runs after each event, e.g. ``sequin_downstream_example``. Never ahead of what is delivered.

A scheduled task, not the supervisor: a task's asset events are recorded when it finishes, so the
long-running ``sequin_replication`` task cannot emit them while it runs.

Settings from the DAG processor's environment (read at parse time; no I/O): ``SEQUIN_FRESHNESS_SCHEDULE``
(cron or preset, default ``*/5 * * * *``), ``SEQUIN_DATABASE`` (default: every database of the config),
``SEQUIN_FRESHNESS_WAIT`` (seconds to wait for the stream to pass the mark, default 60).
Connection: ``sequin_default`` (store, ``config_path``).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import dag

from sequin_provider.operators.freshness import SequinFreshnessOperator


@dag(
    dag_id="sequin_freshness",
    schedule=os.environ.get("SEQUIN_FRESHNESS_SCHEDULE", "*/5 * * * *"),
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["sequin"],
    doc_md=__doc__,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=30)},
)
def sequin_freshness() -> None:
    SequinFreshnessOperator(
        task_id="freshness",
        database=os.environ.get("SEQUIN_DATABASE") or None,
        wait_timeout=float(os.environ.get("SEQUIN_FRESHNESS_WAIT", "60")),
    )


sequin_freshness()
