"""OpenLineage datasets of the operators and the sink-table assets, without a server: exact datasets
from a config, the provider's ``OperatorLineage`` when it is installed (it is, in requirements.lock),
None when it is not (its import made to fail)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sequin_provider.config import load_config
from sequin_provider.operators.assets import sink_table_asset, sink_table_uri
from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.lineage import (
    Lineage,
    LineageDataset,
    backfill_lineage,
    database_lineage,
)
from sequin_provider.operators.replication import SequinReplicationOperator
from tests.support.airflow import sequin_connection
from tests.support.config import write_config

DSN = "postgresql://cdc:secret-pw@db.example:5433/shop"
CONFIG = f"""
databases: [{{name: app, dsn: "{DSN}"}}]
sinks:
  - {{name: orders, tables: [orders, billing.invoices], destination: {{type: sequin_stream}}}}
  - {{name: audit, tables: [public.orders], destination: {{type: sequin_stream}}}}
"""


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    return write_config(tmp_path / "sequin.yaml", CONFIG)


def test_a_backfill_reads_the_source_table_and_writes_the_sink_table(config_path: Path) -> None:
    lineage = backfill_lineage(load_config(config_path), "app", "public.orders", "audit")
    assert lineage == Lineage(
        (LineageDataset("postgres://db.example:5433", "shop.public.orders"),),
        (LineageDataset("sequin://app", "public.orders?sink=audit"),),
    )
    assert "secret-pw" not in repr(lineage)
    # the output is the sink table's asset: the same database, table and sink
    assert sink_table_uri("app", "public.orders", "audit") == "sequin://app/public.orders?sink=audit"
    assert sink_table_asset("app", "public.orders", "audit").uri.endswith(lineage.outputs[0].name)


def test_the_stream_app_reads_every_captured_table_and_writes_every_sink_table(config_path: Path) -> None:
    lineage = database_lineage(load_config(config_path), "app")
    assert [d.name for d in lineage.inputs] == ["shop.public.orders", "shop.billing.invoices"]
    assert [d.name for d in lineage.outputs] == [
        "public.orders?sink=orders",
        "billing.invoices?sink=orders",
        "public.orders?sink=audit",
    ]


def test_operator_lineage_is_the_providers_and_none_without_it(
    config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.providers.openlineage.extractors import OperatorLineage
    from openlineage.client.event_v2 import Dataset

    lineage = backfill_lineage(load_config(config_path), "app", "billing.invoices", "orders")
    made = lineage.operator_lineage()
    assert isinstance(made, OperatorLineage)
    assert made.inputs == [Dataset(namespace="postgres://db.example:5433", name="shop.billing.invoices")]
    assert made.outputs == [Dataset(namespace="sequin://app", name="billing.invoices?sink=orders")]
    monkeypatch.setitem(sys.modules, "airflow.providers.openlineage.extractors", None)  # not installed
    assert lineage.operator_lineage() is None


def test_the_operators_report_their_datasets(config_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_DEFAULT", sequin_connection(DSN, config_path=str(config_path)))
    supervisor = SequinReplicationOperator(task_id="s")
    started = supervisor.get_openlineage_facets_on_start()
    assert [d.name for d in started.outputs] == [
        "public.orders?sink=orders",
        "billing.invoices?sink=orders",
        "public.orders?sink=audit",
    ]
    op = SequinBackfillOperator(task_id="b", sink="audit", table="orders")
    assert op.get_openlineage_facets_on_complete(None) is None  # nothing completed yet
    op._lineage = backfill_lineage(load_config(config_path), "app", "public.orders", "audit")
    assert [d.name for d in op.get_openlineage_facets_on_complete(None).inputs] == ["shop.public.orders"]
    assert [a.name for a in op.outlets] == ["sequin_sink_tables"]  # events go through the alias
