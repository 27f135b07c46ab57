"""The backfill server's metrics, read from the store's backfills table when Prometheus scrapes:
rows processed per sink and table (a counter: ``rate()`` of it is the backfill rate) and backfills
per state. The table is the truth whichever app ran a backfill (this server, a one-off app, an
earlier server), so the numbers survive the server's restarts."""

from __future__ import annotations

import logging
from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sequin_provider.config import SequinConfig
from sequin_provider.metrics.core import scrape_connection, up_family
from sequin_provider.store.backfills import backfill_totals

log = logging.getLogger(__name__)


class BackfillMetrics(Collector):
    """The metrics of a backfill server serving ``databases`` (``registry``: serve it with
    ``core.serve_metrics``)."""

    def __init__(self, config: SequinConfig, databases: list[str]) -> None:
        self.config = config
        self.databases = list(databases)
        self.sinks = {s.name: s.database for s in config.sinks}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def _families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        labels = ["database", "sink", "table"]
        return (
            CounterMetricFamily(
                "sequin_backfill_rows",
                "Rows backfills have processed (read from the table), per sink and table",
                labels=labels,
            ),
            GaugeMetricFamily("sequin_backfills", "Backfills per state", labels=[*labels, "state"]),
            up_family("sequin_store_up", "1 when this scrape could read the store", "database"),
        )

    def describe(self) -> Iterator[Metric]:
        """The families, without reading anything."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """Read each database's store (once per store; bounded by ``core``'s timeouts)."""
        rows, states, up = self._families()
        read: set[str] = set()
        for database in self.databases:
            dsn = self.config.store_dsn(database)
            if dsn in read:  # one store shared by several databases: its table was read already
                up.add_metric([database], 1)
                continue
            try:
                with scrape_connection(dsn) as conn:
                    totals = backfill_totals(conn, self.config.store.schema)
                read.add(dsn)
                up.add_metric([database], 1)
            except Exception as exc:  # noqa: BLE001 - a scrape never fails on a store that is down
                log.debug("metrics: the backfills of %r could not be read: %s", database, exc)
                up.add_metric([database], 0)
                continue
            processed: dict[tuple[str, str, str], int] = {}
            for sink, table_schema, table_name, state, count, n in totals:
                owner = self.sinks.get(sink, database)  # a sink no longer configured: the store's database
                if owner not in self.databases:
                    continue
                key = (owner, sink, f"{table_schema}.{table_name}")
                processed[key] = processed.get(key, 0) + n
                states.add_metric([*key, state], count)
            for key, n in sorted(processed.items()):
                rows.add_metric(list(key), n)
        yield rows
        yield states
        yield up
