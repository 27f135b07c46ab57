"""``sequin_buffer_retry``: every minute, redeliver the parked messages that are due (docs/buffer.md).

One sink (``SEQUIN_RETRY_SINK`` in the DAG processor's environment) or, by default, every sink. A
run succeeds while messages stay parked (the ``sequin_monitoring`` DAG alerts on those) and
returns ``{delivered, still_parked, discarded}``. One run at a time; the per-sink advisory lock of
the retry also keeps it from overlapping a ``sequin buffer retry`` started by hand.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import dag

from sequin_provider.operators.buffer import SequinBufferRetryOperator


@dag(
    dag_id="sequin_buffer_retry",
    schedule="* * * * *",
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["sequin"],
    doc_md=__doc__,
)
def sequin_buffer_retry() -> None:
    SequinBufferRetryOperator(
        task_id="retry_parked",
        sink=os.environ.get("SEQUIN_RETRY_SINK") or None,
        execution_timeout=timedelta(minutes=10),
    )


sequin_buffer_retry()
