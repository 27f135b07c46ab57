"""Every sink table is an Airflow Asset; the operators emit its events (DESIGN §10).

``sequin://<database>/<schema>.<table>?sink=<sink>``: the table of a source database *as delivered
to one sink*. The sink is part of the URI (a query parameter, which Airflow keeps) because Airflow
holds asset names and URIs one-to-one: two sinks of the same table are two assets, and may be at
different points (one has parked messages). The name is ``sequin:<database>/<schema>.<table>@<sink>``,
the group ``sequin``, and the asset's extra names the database, the table and the sink.

The operators learn which sink and table at run time (a form, a config), so they declare one
``AssetAlias`` (``SINK_TABLES_ALIAS``) as their outlet and add each event through it
(``outlet_events[alias].add(asset, extra)``, Airflow's way for assets known only at run time):
nothing about the config is needed when the DAG is parsed, and only the tables an operator
actually completed get an event. Airflow creates an asset the first time an event names it; a DAG
scheduled on ``sink_table_asset(...)`` is queued by each event of it.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from airflow.sdk import Asset, AssetAlias

log = logging.getLogger(__name__)

ASSET_SCHEME = "sequin"
ASSET_GROUP = "sequin"
SINK_TABLES_ALIAS = "sequin_sink_tables"
"""The alias the operators emit sink-table events through."""


def sink_table_uri(database: str, table: str, sink: str) -> str:
    """``sequin://<database>/<schema>.<table>?sink=<sink>`` (``table``: ``schema.table``)."""
    return f"{ASSET_SCHEME}://{quote(database, safe='')}/{quote(table, safe='.')}?sink={quote(sink, safe='')}"


def sink_table_asset(database: str, table: str, sink: str) -> Asset:
    """The Asset of ``table`` (``schema.table``) of ``database`` as delivered to ``sink``."""
    return Asset(
        name=f"{ASSET_SCHEME}:{database}/{table}@{sink}",
        uri=sink_table_uri(database, table, sink),
        group=ASSET_GROUP,
        extra={"database": database, "table": table, "sink": sink},
    )


def sink_tables_alias() -> AssetAlias:
    """The alias of every sink-table asset event the operators emit (their outlet)."""
    return AssetAlias(name=SINK_TABLES_ALIAS, group=ASSET_GROUP)


def emit_sink_table_event(context: Any, asset: Asset, extra: dict[str, Any]) -> bool:
    """Add an event of ``asset`` with ``extra`` through the alias; False (and a log line) when the
    task has no ``outlet_events`` (run outside Airflow) or does not have the alias as an outlet."""
    events = context.get("outlet_events") if context else None
    if events is None:
        log.info("no outlet_events in the context: asset event of %s not emitted (%s)", asset.uri, extra)
        return False
    events[sink_tables_alias()].add(asset, extra=extra)
    log.info("asset event of %s: %s", asset.uri, extra)
    return True
