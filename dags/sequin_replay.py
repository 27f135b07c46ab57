"""``sequin_replay``: on a schedule, deliver one table's data of the run's data interval into a sink
again, in one of two modes (``mode`` param):

- ``rows`` (the default): a partial backfill with ``start_position = data_interval_start``: the rows
  changed since then, in their current state, e.g. to repair a consumer that lost a day of messages,
  or to feed a sink that is rebuilt nightly. The sort column should be a timestamp that every write sets.
  A backfill has a start and no end: rows whose sort value is past ``data_interval_end`` are read too.
- ``changes``: a replay of the changes committed in ``[data_interval_start, data_interval_end)`` that
  a changelog sink kept (``source``: a ``postgres_table`` or ``iceberg`` sink with ``mode: changelog``),
  matching the optional SQL condition ``where`` over the changelog's columns: every insert, update and
  delete again, marked as replayed (docs/replays.md).

Which sink, table and sort column: Airflow Variables ``sequin_replay_sink``, ``sequin_replay_table``,
``sequin_replay_sort_column`` (read when the task runs, through templates), else the run's params,
whose defaults come from the DAG processor's environment (``SEQUIN_REPLAY_SINK``,
``SEQUIN_REPLAY_TABLE``, ``SEQUIN_REPLAY_SORT_COLUMN``, ``SEQUIN_REPLAY_MODE``, ``SEQUIN_REPLAY_SOURCE``;
defaults ``orders``, ``public.orders``, ``updated_at``, ``rows``, ``changes``). The schedule comes from
``SEQUIN_REPLAY_SCHEDULE`` (default ``@daily``): a schedule must be known at parse time, where
Variables must not be read. A manual run has no data interval: give ``start_position`` (and, for
changes, ``end_position``) in its config.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import Param, dag, task

from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.replay import SequinReplayOperator

START = "{{ params.start_position or (data_interval_start.isoformat() if data_interval_start else '') }}"
END = "{{ params.end_position or (data_interval_end.isoformat() if data_interval_end else '') }}"


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
        "mode": Param(os.environ.get("SEQUIN_REPLAY_MODE", "rows"), type="string", enum=["rows", "changes"]),
        "sink": Param(os.environ.get("SEQUIN_REPLAY_SINK", "orders"), type="string"),
        "table": Param(os.environ.get("SEQUIN_REPLAY_TABLE", "public.orders"), type="string"),
        "sort_column": Param(os.environ.get("SEQUIN_REPLAY_SORT_COLUMN", "updated_at"), type="string"),
        "source": Param(
            os.environ.get("SEQUIN_REPLAY_SOURCE", "changes"),
            type="string",
            description="changes mode: the changelog sink the changes are replayed from.",
        ),
        "where": Param(
            None, type=["null", "string"], description="changes mode: an SQL condition over the changelog's columns."
        ),
        "start_position": Param(
            None, type=["null", "string"], description="Overrides data_interval_start (manual runs have none)."
        ),
        "end_position": Param(None, type=["null", "string"], description="changes mode: overrides data_interval_end."),
    },
)
def sequin_replay() -> None:
    @task.branch(task_id="mode")
    def mode(params: dict | None = None) -> str:
        """``replay`` (rows) or ``replay_changes``, by the run's ``mode`` param."""
        return "replay_changes" if (params or {}).get("mode") == "changes" else "replay"

    rows = SequinBackfillOperator(
        task_id="replay",
        sink="{{ var.value.get('sequin_replay_sink', params.sink) }}",
        table="{{ var.value.get('sequin_replay_table', params.table) }}",
        kind="partial",
        sort_column="{{ var.value.get('sequin_replay_sort_column', params.sort_column) }}",
        start_position=START,
    )
    changes = SequinReplayOperator(
        task_id="replay_changes",
        source="{{ params.source }}",
        sink="{{ var.value.get('sequin_replay_sink', params.sink) }}",
        tables="{{ var.value.get('sequin_replay_table', params.table) }}",
        since=START,
        until=END,
        where="{{ params.where or '' }}",
    )
    mode() >> [rows, changes]


sequin_replay()
