"""``sequin_replay``: on a schedule, replay one table's rows changed since the run's data interval
started (a partial backfill with ``start_position = data_interval_start``) into a sink, e.g. to
repair a consumer that lost a day of messages, or to feed a sink that is rebuilt nightly.

Which sink, table and sort column: Airflow Variables ``sequin_replay_sink``, ``sequin_replay_table``,
``sequin_replay_sort_column`` (read when the task runs, through templates), else the run's params,
whose defaults come from the DAG processor's environment (``SEQUIN_REPLAY_SINK``,
``SEQUIN_REPLAY_TABLE``, ``SEQUIN_REPLAY_SORT_COLUMN``; defaults ``orders``, ``public.orders``,
``updated_at``). The schedule comes from ``SEQUIN_REPLAY_SCHEDULE`` (default ``@daily``): a schedule
must be known at parse time, where Variables must not be read. The sort column should be a
timestamp that every write sets.

A backfill has a start and no end: rows whose sort value is past ``data_interval_end`` are read too
(with their current state, which is what a replay wants). A manual run has no data interval: give
``start_position`` in its config.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import Param, dag

from sequin_provider.operators.backfill import SequinBackfillOperator


@dag(
    dag_id="sequin_replay",
    schedule=os.environ.get("SEQUIN_REPLAY_SCHEDULE", "@daily"),
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,  # one active backfill per sink and table anyway
    tags=["sequin"],
    doc_md=__doc__,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=5)},
    params={
        "sink": Param(os.environ.get("SEQUIN_REPLAY_SINK", "orders"), type="string"),
        "table": Param(os.environ.get("SEQUIN_REPLAY_TABLE", "public.orders"), type="string"),
        "sort_column": Param(os.environ.get("SEQUIN_REPLAY_SORT_COLUMN", "updated_at"), type="string"),
        "start_position": Param(
            None, type=["null", "string"], description="Overrides data_interval_start (manual runs have none)."
        ),
    },
)
def sequin_replay() -> None:
    SequinBackfillOperator(
        task_id="replay",
        sink="{{ var.value.get('sequin_replay_sink', params.sink) }}",
        table="{{ var.value.get('sequin_replay_table', params.table) }}",
        kind="partial",
        sort_column="{{ var.value.get('sequin_replay_sort_column', params.sort_column) }}",
        start_position="{{ params.start_position"
        " or (data_interval_start.isoformat() if data_interval_start else '') }}",
    )


sequin_replay()
