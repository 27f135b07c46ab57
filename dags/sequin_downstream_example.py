"""``sequin_downstream_example``: a DAG that runs when a sink table has new data, scheduled on its Asset.

An example to copy: it is scheduled on the asset of one sink table (docs/assets.md), so it runs after
each event of it: a completed backfill (``sequin_backfill``, ``sequin_replay``; extra ``rows``,
``position``) or a freshness event (``sequin_freshness``; extra ``complete_through``). Its task reads
the events that triggered the run and returns, per event, what it says, e.g. "public.orders delivered
to sink orders through 2025-06-01T10:00:00+00:00": where a report of "orders up to 10:00" would start.

Settings from the DAG processor's environment (read at parse time; no I/O): ``SEQUIN_EXAMPLE_DATABASE``
(``app``), ``SEQUIN_EXAMPLE_TABLE`` (``public.orders``), ``SEQUIN_EXAMPLE_SINK`` (``orders``).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Any

from airflow.sdk import dag, task

from sequin_provider.operators.assets import sink_table_asset

ORDERS = sink_table_asset(
    os.environ.get("SEQUIN_EXAMPLE_DATABASE", "app"),
    os.environ.get("SEQUIN_EXAMPLE_TABLE", "public.orders"),
    os.environ.get("SEQUIN_EXAMPLE_SINK", "orders"),
)


@dag(
    dag_id="sequin_downstream_example",
    schedule=[ORDERS],
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["sequin", "example"],
    doc_md=__doc__,
)
def sequin_downstream_example() -> None:
    @task(inlets=[ORDERS])
    def delivered(triggering_asset_events: Any = None) -> list[dict[str, Any]]:
        """What the triggering events say: backfilled rows, or the commit time the table is complete through."""
        seen = []
        for event in (triggering_asset_events or {}).get(ORDERS, []):
            extra = dict(event.extra or {})
            if extra.get("event") == "freshness":
                print(f"{extra['table']} delivered to sink {extra['sink']} through {extra['complete_through']}")
            else:
                print(f"{extra.get('table')}: backfill {extra.get('backfill_id')} delivered {extra.get('rows')} rows")
            seen.append(extra)
        return seen

    delivered()


sequin_downstream_example()
