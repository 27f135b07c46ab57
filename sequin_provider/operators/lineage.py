"""OpenLineage datasets of the operators, when ``apache-airflow-providers-openlineage`` is installed.

A backfill reads a table of the source database and writes it to a sink; the stream app does that for
every table of its database's sinks. Inputs follow OpenLineage's naming for Postgres (namespace
``postgres://<host>:<port>``, name ``<database>.<schema>.<table>``); an output is the sink table, in
the namespace of this product's assets (``sequin://<database>``, name ``<schema>.<table>?sink=<sink>``,
the path and query of ``operators.assets.sink_table_uri``). ``Lineage`` is plain data; only
``operator_lineage`` imports the provider, and returns None without it, so the operators work alike
with or without it (Airflow calls ``get_openlineage_facets_on_*`` only when it is installed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg.conninfo import conninfo_to_dict

from sequin_provider.operators.assets import ASSET_SCHEME

if TYPE_CHECKING:
    from sequin_provider.config import SequinConfig


@dataclass(frozen=True)
class LineageDataset:
    """An OpenLineage dataset: its namespace and name."""

    namespace: str
    name: str


@dataclass(frozen=True)
class Lineage:
    """What a task read (``inputs``) and wrote (``outputs``)."""

    inputs: tuple[LineageDataset, ...]
    outputs: tuple[LineageDataset, ...]

    def operator_lineage(self) -> Any:
        """The provider's ``OperatorLineage`` of these datasets; None when the provider is not installed."""
        try:
            from airflow.providers.openlineage.extractors import OperatorLineage
            from openlineage.client.event_v2 import Dataset
        except ImportError:
            return None
        return OperatorLineage(
            inputs=[Dataset(namespace=d.namespace, name=d.name) for d in self.inputs],
            outputs=[Dataset(namespace=d.namespace, name=d.name) for d in self.outputs],
        )


def source_dataset(dsn: str, table: str) -> LineageDataset:
    """The source table ``table`` (``schema.table``) of the database at ``dsn`` (no credentials kept)."""
    parts = conninfo_to_dict(dsn)
    host = str(parts.get("host") or "localhost").split(",")[0]
    port = str(parts.get("port") or "5432").split(",")[0]
    return LineageDataset(f"postgres://{host}:{port}", f"{parts.get('dbname') or parts.get('user') or ''}.{table}")


def sink_dataset(database: str, table: str, sink: str) -> LineageDataset:
    """The sink table: ``table`` of ``database`` as delivered to ``sink``."""
    return LineageDataset(f"{ASSET_SCHEME}://{database}", f"{table}?sink={sink}")


def backfill_lineage(config: SequinConfig, database: str, table: str, sink: str) -> Lineage:
    """A backfill of ``table`` into ``sink``: the source table in, the sink table out."""
    return Lineage((source_dataset(config.database(database).dsn, table),), (sink_dataset(database, table, sink),))


def database_lineage(config: SequinConfig, database: str) -> Lineage:
    """The stream app of ``database``: every table its sinks capture in, every sink table out."""
    dsn = config.database(database).dsn
    pairs = [(t.qualified, s.name) for s in config.sinks if s.database == database for t in s.tables]
    inputs = tuple(dict.fromkeys(source_dataset(dsn, table) for table, _ in pairs))
    return Lineage(inputs, tuple(sink_dataset(database, table, sink) for table, sink in pairs))
