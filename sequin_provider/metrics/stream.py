"""The stream app's metrics, on its driver.

Delivery runs in the executors' Python workers (short-lived, maybe on other hosts), so nothing is
counted there: each micro-batch's tasks report what they read, wrote, delivered and parked
(``spark.pipeline``), and the driver adds the batch's reports here (``StreamMetrics.record_batch``).
The slot's lag, the heartbeat's age and the buffer's counts are read when Prometheus scrapes
(``StreamStateCollector``), with short timeouts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sequin_provider import store
from sequin_provider.config import SequinConfig
from sequin_provider.metrics.core import WeightedHistogram, scrape_connection, up_family
from sequin_provider.replication import slot_info
from sequin_provider.store.status import status_ages

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
"""Seconds from a change's commit to the end of the micro-batch that made it durable."""
BATCH_ROWS_BUCKETS = (1, 10, 100, 1_000, 5_000, 20_000, 50_000, 100_000, 200_000, 500_000)
BATCH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
COMMIT_TIMESTAMP_PRECISION_MS = 10
"""The executors report a batch's commit timestamps truncated to 10 ms, with how many changes each
(``spark.pipeline.commit_time_counts``): one entry per 10 ms of commits, however many changes."""


@dataclass
class BatchReport:
    """What the driver knows once a micro-batch is done: its change rows, seconds, the messages
    delivered and parked per sink (in ``config.sinks_of(database)`` order) and its changes'
    commit times (epoch milliseconds, with how many changes each)."""

    rows: int
    seconds: float
    delivered: Sequence[int]
    parked: Sequence[int]
    commit_ms: Sequence[int] = field(default_factory=list)
    commit_counts: Sequence[int] = field(default_factory=list)
    finished_ms: float = 0.0


class StreamMetrics:
    """The metrics of one database's stream app (``registry``: serve it with ``core.serve_metrics``)."""

    def __init__(self, config: SequinConfig, database: str) -> None:
        self.database = database
        self.sinks = [s.name for s in config.sinks_of(database)]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.changes = Counter(
            "sequin_changes", "Change rows read from the slot by micro-batches", ["database"], registry=r
        )
        self.delivered = Counter(
            "sequin_messages_delivered",
            "Messages made durable per sink: written to the stream table (Sequin Stream), delivered (pushed"
            " destinations) or committed (Iceberg); a micro-batch replayed after a crash counts again",
            ["database", "sink"],
            registry=r,
        )
        self.parked = Counter(
            "sequin_messages_parked",
            "Messages the stream app parked in the buffer per sink (failed, or behind a failed one)",
            ["database", "sink"],
            registry=r,
        )
        self.batch_rows = Histogram(
            "sequin_batch_rows",
            "Change rows per micro-batch (batches with changes)",
            ["database"],
            buckets=BATCH_ROWS_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "sequin_batch_duration_seconds",
            "Seconds per micro-batch, from foreachBatch's start to every sink durable (batches with changes)",
            ["database"],
            buckets=BATCH_SECONDS_BUCKETS,
            registry=r,
        )
        self.latency = WeightedHistogram(
            "sequin_commit_to_durable_seconds",
            "Seconds from a change's commit in the source to the end of the micro-batch that made it durable in"
            " every sink (10 ms resolution; the source's and the driver's clocks)",
            ["database"],
            LATENCY_BUCKETS,
        )
        r.register(self.latency)
        r.register(StreamStateCollector(config, database))
        self.changes.labels(database)
        self.batch_rows.labels(database)
        self.batch_seconds.labels(database)
        self.latency.labels(database)
        for sink in self.sinks:
            self.delivered.labels(database, sink)
            self.parked.labels(database, sink)

    def record_batch(self, report: BatchReport) -> None:
        """Add a finished micro-batch's report (an empty batch counts nowhere)."""
        db = self.database
        for sink, delivered, parked in zip(self.sinks, report.delivered, report.parked):
            if delivered:
                self.delivered.labels(db, sink).inc(delivered)
            if parked:
                self.parked.labels(db, sink).inc(parked)
        if not report.rows:
            return
        self.changes.labels(db).inc(report.rows)
        self.batch_rows.labels(db).observe(report.rows)
        self.batch_seconds.labels(db).observe(report.seconds)
        if len(report.commit_ms):
            ages = (report.finished_ms - np.asarray(report.commit_ms, dtype=np.float64)) / 1000.0
            self.latency.observe_many((db,), np.maximum(ages, 0.0), report.commit_counts)

    def park(self, parked: dict[str, int]) -> None:
        """Count messages the driver parked itself (a sink's filter failed on them)."""
        for sink, n in parked.items():
            self.parked.labels(self.database, sink).inc(n)


class StreamStateCollector(Collector):
    """Read at scrape time: the slot's lag and retained WAL (the source), the heartbeat's and the last
    micro-batch's age (the store's status row, on the store's clock), and the buffer's parked and
    discarded messages per sink. A source or store that cannot be read within the timeouts is
    ``sequin_source_up`` / ``sequin_store_up`` 0 and its gauges are left out."""

    def __init__(self, config: SequinConfig, database: str) -> None:
        self.config = config
        self.db = config.database(database)
        self.sinks = {s.name for s in config.sinks_of(database)}

    def describe(self) -> Iterator[Metric]:
        """The families, without reading anything."""
        yield from self._families().values()

    def _families(self) -> dict[str, GaugeMetricFamily]:
        slot = ["database", "slot"]
        return {
            "lag": GaugeMetricFamily(
                "sequin_slot_lag_bytes",
                "WAL bytes between the server's position and the slot's confirmed one",
                labels=slot,
            ),
            "retained": GaugeMetricFamily(
                "sequin_slot_retained_bytes", "WAL bytes the slot retains (from its restart position)", labels=slot
            ),
            "active": GaugeMetricFamily("sequin_slot_active", "1 while a process streams from the slot", labels=slot),
            "heartbeat": GaugeMetricFamily(
                "sequin_heartbeat_age_seconds", "Seconds since the stream app's last heartbeat", labels=["database"]
            ),
            "batch": GaugeMetricFamily(
                "sequin_last_batch_age_seconds", "Seconds since the stream app's last micro-batch", labels=["database"]
            ),
            "parked": GaugeMetricFamily(
                "sequin_buffer_parked_messages", "Messages parked in the buffer now, per sink", labels=["sink"]
            ),
            "discarded": GaugeMetricFamily(
                "sequin_buffer_discarded_messages",
                "Messages kept as discarded in the buffer, per sink",
                labels=["sink"],
            ),
            "source_up": up_family("sequin_source_up", "1 when this scrape could read the slot", "database"),
            "store_up": up_family("sequin_store_up", "1 when this scrape could read the store", "database"),
        }

    def collect(self) -> Iterator[Metric]:
        """Read the source and the store (bounded by ``core``'s timeouts)."""
        f = self._families()
        db = self.db
        try:
            with scrape_connection(db.dsn) as conn:
                info = slot_info(conn, db.slot.name)
            if info is not None:
                if info.lag_bytes is not None:
                    f["lag"].add_metric([db.name, db.slot.name], info.lag_bytes)
                if info.retained_bytes is not None:
                    f["retained"].add_metric([db.name, db.slot.name], info.retained_bytes)
                f["active"].add_metric([db.name, db.slot.name], 1 if info.active else 0)
            f["source_up"].add_metric([db.name], 1)
        except Exception as exc:  # noqa: BLE001 - a scrape never fails on a source that is down
            log.debug("metrics: the slot of %r could not be read: %s", db.name, exc)
            f["source_up"].add_metric([db.name], 0)
        try:
            with scrape_connection(self.config.store_dsn(db.name)) as conn:
                ages = status_ages(conn, self.config.store.schema)
                buffered = store.buffer_counts(conn, self.config.store.schema)
            for database, heartbeat, batch in ages:
                if database != db.name:
                    continue
                if heartbeat is not None:
                    f["heartbeat"].add_metric([database], heartbeat)
                if batch is not None:
                    f["batch"].add_metric([database], batch)
            for sink in sorted(self.sinks):
                counts = buffered.get(sink, {})
                f["parked"].add_metric([sink], counts.get("parked", 0))
                f["discarded"].add_metric([sink], counts.get("discarded", 0))
            f["store_up"].add_metric([db.name], 1)
        except Exception as exc:  # noqa: BLE001 - nor on a store that is down
            log.debug("metrics: the store of %r could not be read: %s", db.name, exc)
            f["store_up"].add_metric([db.name], 0)
        yield from f.values()
