"""``sequin_backfill``: start a backfill from the UI ("Trigger DAG" shows the form below).

Sends the rows a table holds now to one sink as ``read`` messages (docs/backfills.md): ``full`` reads
every row in primary-key order; ``partial`` reads rows with ``sort_column >= start_position``.
The stream app of the sink's database must be running.

``sink`` is a drop-down of the sinks of ``sequin.yaml``, and ``table`` suggests their tables (free
text: ``items`` is taken for ``public.items``), when the DAG processor can read the file cheaply at
parse time: ``$SEQUIN_CONFIG`` names a regular file of at
most 1 MB that parses as YAML (``sequin_provider.dag_config``: no connection lookup, no network, no
validation). Otherwise (unset, missing, unreadable, a FIFO) they are free text, since parse-time I/O
that can fail or hang is what Airflow's DAG processor must not do. Either way the operator checks
them when the run starts and fails with the reason, e.g. ``unknown sink 'x' (configured sinks:
orders, users)``.
Connections: ``sequin_default`` and ``spark_default``.
"""

from __future__ import annotations

from airflow.sdk import Param, dag

from sequin_provider.dag_config import configured_sink_tables, sink_choices, table_choices
from sequin_provider.operators.backfill import SequinBackfillOperator

SINKS = configured_sink_tables()  # None unless $SEQUIN_CONFIG is a small regular file (no other I/O)


@dag(
    dag_id="sequin_backfill",
    schedule=None,
    catchup=False,
    tags=["sequin"],
    doc_md=__doc__,
    render_template_as_native_obj=True,  # unset fields stay None, max_query_ms stays an integer
    params={
        "sink": Param(
            type="string", minLength=1, title="Sink", description="A sink of sequin.yaml.", **sink_choices(SINKS)
        ),
        "table": Param(
            type="string",
            minLength=1,
            title="Table",
            description="One of the sink's tables: schema.table (public. if no schema).",
            **table_choices(SINKS),
        ),
        "kind": Param(
            "full",
            type="string",
            enum=["full", "partial"],
            title="Kind",
            values_display={"full": "full: every row", "partial": "partial: from a start position"},
        ),
        "sort_column": Param(
            None,
            type=["null", "string"],
            title="Sort column",
            description="partial only: the column to order and start by, e.g. updated_at.",
        ),
        "start_position": Param(
            None,
            type=["null", "string"],
            title="Start position",
            description="partial only: the first value of the sort column, "
            "e.g. 2025-01-01 00:00:00+00 (cast by Postgres to the column's type).",
        ),
        "max_query_ms": Param(
            5000,
            type="integer",
            minimum=1,
            maximum=600000,
            title="Query timeout (ms)",
            description="Time budget of one page query; pages shrink when they hit it.",
        ),
        "where": Param(
            None,
            type=["null", "string"],
            title="Only rows where",
            description="optional: an SQL condition over the table's columns, e.g. status = 'paid' AND "
            "region = 'eu'; only matching rows are sent. Runs on the source (for operators). Empty: every row.",
        ),
    },
)
def sequin_backfill() -> None:
    SequinBackfillOperator(
        task_id="backfill",
        sink="{{ params.sink }}",
        table="{{ params.table }}",
        kind="{{ params.kind }}",
        sort_column="{{ params.sort_column }}",
        start_position="{{ params.start_position }}",
        max_query_ms="{{ params.max_query_ms }}",
        where="{{ params.where }}",
    )


sequin_backfill()
