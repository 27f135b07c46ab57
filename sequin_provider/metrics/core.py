"""What the processes' metrics share: a histogram fed counts at once, the ``/metrics`` server of a
Spark app, and bounded connections for reads at scrape time."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import psycopg
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sequin_provider.config import SequinConfig
from sequin_provider.exceptions import ConfigError

log = logging.getLogger(__name__)

SCRAPE_CONNECT_TIMEOUT = 3
"""Seconds a scrape waits to connect to the store or a source (Prometheus' default timeout is 10 s)."""
SCRAPE_STATEMENT_TIMEOUT_MS = 2000
"""The longest a scrape's query runs before Postgres cancels it."""


class WeightedHistogram(Collector):
    """A Prometheus histogram fed many observations at once (``observe_many``: values and how many
    times each was seen), for counts the driver gets already aggregated from the executors."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.bounds = np.asarray(sorted(float(b) for b in buckets), dtype=np.float64)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], tuple[np.ndarray, float]] = {}

    def labels(self, *values: str) -> None:
        """Make the series of ``values`` exist (at zero) before anything is observed."""
        with self._lock:
            self._series.setdefault(tuple(values), (np.zeros(len(self.bounds) + 1, dtype=np.float64), 0.0))

    def observe_many(self, labels: Sequence[str], values: Any, weights: Any = None) -> None:
        """Observe each of ``values`` (seconds, rows, ...) ``weights`` times (once when None)."""
        values = np.asarray(values, dtype=np.float64)
        if not values.size:
            return
        weights = np.ones_like(values) if weights is None else np.asarray(weights, dtype=np.float64)
        # bucket i counts values <= bounds[i]; the last one (+Inf) the rest
        counts = np.bincount(np.searchsorted(self.bounds, values, side="left"), weights, len(self.bounds) + 1)
        total = float(np.dot(values, weights))
        key = tuple(labels)
        with self._lock:
            before, before_sum = self._series.get(key, (np.zeros(len(self.bounds) + 1), 0.0))
            self._series[key] = (before + counts, before_sum + total)

    def describe(self) -> Iterator[Metric]:
        """The family without samples (the registry checks names with it)."""
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        """Cumulative buckets, count and sum of every series."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            series = list(self._series.items())
        for key, (counts, total) in series:
            cumulative = np.cumsum(counts)
            buckets = [(floatToGoString(b), float(c)) for b, c in zip(self.bounds, cumulative[:-1])]
            buckets.append(("+Inf", float(cumulative[-1])))
            family.add_metric(list(key), buckets, total)
        yield family


@dataclass
class MetricsServer:
    """A ``/metrics`` HTTP server running in a daemon thread of a Spark app's driver."""

    server: Any
    thread: threading.Thread

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.server.server_address[1])

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` (any path answers) from a daemon thread."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics: http://%s:%d/metrics", host, server.server_address[1])
    return MetricsServer(server, thread)


def scrape_connection(dsn: str) -> psycopg.Connection[Any]:
    """A connection for one scrape's reads: connects within ``SCRAPE_CONNECT_TIMEOUT`` seconds, and
    its statements are cancelled after ``SCRAPE_STATEMENT_TIMEOUT_MS``."""
    conn = psycopg.connect(
        dsn, connect_timeout=SCRAPE_CONNECT_TIMEOUT, autocommit=True, application_name="sequin-metrics"
    )
    try:
        conn.execute(f"SET statement_timeout = {int(SCRAPE_STATEMENT_TIMEOUT_MS)}")
    except BaseException:
        conn.close()
        raise
    return conn


def up_family(name: str, documentation: str, label: str) -> GaugeMetricFamily:
    """A ``..._up`` gauge family (1: the scrape could read it, 0: it could not)."""
    return GaugeMetricFamily(name, documentation, labels=[label])


def serve_configured(
    config: SequinConfig, process: str, offset: int, registry: CollectorRegistry
) -> MetricsServer | None:
    """Serve ``registry`` on the port ``metrics.<process>_port`` gives the app of the database at index
    ``offset``; None when that port is not set. A port that cannot be bound is a ``ConfigError``."""
    port = config.metrics.port(process, offset)
    if port is None:
        return None
    try:
        return serve_metrics(registry, config.metrics.host, port)
    except OSError as exc:
        raise ConfigError(
            config.source,
            f"metrics.{process}_port",
            f"cannot serve /metrics on {config.metrics.host}:{port}: {exc.strerror or exc}",
        ) from None
