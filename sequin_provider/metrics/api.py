"""The pull API's metrics: requests and messages counted in the API process, the messages each sink
has outstanding (received, neither acked nor nacked) read from the store when Prometheus scrapes.

Counters are per API process (each of Airflow's API server workers, when the API runs as its
plugin, counts its own requests: sum them in PromQL); the outstanding gauge is the store's, the
same in every process."""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sequin_provider.metrics.core import scrape_connection, up_family
from sequin_provider.store.stream_queue import pending_counts

log = logging.getLogger(__name__)


class ApiMetrics:
    """The API process's counters per Sequin Stream sink, and its ``/metrics`` text (``render``)."""

    def __init__(self, sinks: Sequence[str], stores: dict[str, tuple[str, str]], schema: str) -> None:
        """``stores``: each sink's database and its store's DSN (read at scrape time only)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.receives = Counter(
            "sequin_api_receive_requests", "Receive requests answered (with or without messages)", ["sink"], registry=r
        )
        self.received = Counter("sequin_api_messages_received", "Messages handed out by receives", ["sink"], registry=r)
        self.acked = Counter("sequin_api_messages_acked", "Messages acked (deleted)", ["sink"], registry=r)
        self.nacked = Counter("sequin_api_messages_nacked", "Messages nacked (visible again)", ["sink"], registry=r)
        self.rejected = Counter(
            "sequin_api_too_many_requests",
            "Long polls refused with 429: max_waiting receivers already waited on the sink",
            ["sink"],
            registry=r,
        )
        self.claims = Counter(
            "sequin_api_store_claims",
            "Claims of messages from the store for receives: one serves every receive of the sink waiting for it",
            ["sink"],
            registry=r,
        )
        self.in_claim_rounds = Gauge(
            "sequin_api_receives_in_claim_rounds",
            "Receives waiting for a claim of the store or in one (a round serves every receive waiting)",
            ["sink"],
            registry=r,
        )
        r.register(OutstandingCollector(stores, schema))
        for sink in sinks:
            for counter in (self.receives, self.received, self.acked, self.nacked, self.rejected, self.claims):
                counter.labels(sink)
            self.in_claim_rounds.labels(sink)

    def render(self) -> bytes:
        """The exposition text (reads the store: call it off the event loop)."""
        return generate_latest(self.registry)


class OutstandingCollector(Collector):
    """``sequin_stream_outstanding_messages`` per sink from each store's pending counters
    (``store.stream_queue.pending_counts``: a small table, no count over the messages)."""

    def __init__(self, stores: dict[str, tuple[str, str]], schema: str) -> None:
        self.stores = stores
        self.schema = schema

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "sequin_stream_outstanding_messages",
                "Messages received and neither acked nor nacked yet (max_ack_pending counts them)",
                labels=["sink"],
            ),
            up_family("sequin_store_up", "1 when this scrape could read the store", "database"),
        )

    def describe(self) -> Iterator[Metric]:
        """The families, without reading anything."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """Read every store once (bounded by ``core``'s timeouts)."""
        outstanding, up = self._families()
        by_store: dict[str, tuple[set[str], list[str]]] = {}
        for sink, (database, dsn) in self.stores.items():
            databases, sinks = by_store.setdefault(dsn, (set(), []))
            databases.add(database)
            sinks.append(sink)
        for dsn, (databases, sinks) in sorted(by_store.items()):
            try:
                with scrape_connection(dsn) as conn:
                    pending = pending_counts(conn, self.schema)
                for sink in sorted(sinks):
                    outstanding.add_metric([sink], pending.get(sink, 0))
                readable = 1
            except Exception as exc:  # noqa: BLE001 - a scrape never fails on a store that is down
                log.debug("metrics: the store of %s could not be read: %s", ", ".join(sorted(databases)), exc)
                readable = 0
            for database in sorted(databases):
                up.add_metric([database], readable)
        yield outstanding
        yield up
