"""The metrics' parts without a server: the ``metrics:`` options, the histogram fed counts at once, a
micro-batch's report on the driver, the executors' commit-time counts, and the Grafana dashboard
against docs/metrics.md. (After a real workload: tests/integration/test_metrics.py.)"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sequin_provider.config import ConfigError, MetricsConfig, parse_config
from sequin_provider.metrics.core import WeightedHistogram
from sequin_provider.metrics.stream import BatchReport, StreamMetrics
from sequin_provider.spark.pipeline import CommitTimes
from tests.support.metrics import dashboard_queries, documented_names, queried_names

UNREACHABLE = "postgresql://127.0.0.1:1/nothing"
"""Nothing listens on port 1: a scrape's read fails at once (connection refused)."""


def config_with(metrics: Any, databases: int = 1) -> Any:
    return parse_config(
        {
            "databases": [{"name": f"db{i}", "dsn": UNREACHABLE} for i in range(databases)],
            "sinks": [
                {"name": "a", "database": "db0", "tables": ["t"], "destination": {"type": "sequin_stream"}},
                {
                    "name": "b",
                    "database": "db0",
                    "tables": ["t"],
                    "destination": {"type": "webhook", "url": "http://x/"},
                },
            ],
            **({"metrics": metrics} if metrics is not None else {}),
        },
        "sequin.yaml",
        environ={},
    )


def test_metrics_are_off_for_the_spark_apps_and_on_for_the_api_by_default() -> None:
    assert config_with(None).metrics == MetricsConfig()
    assert MetricsConfig().port("stream") is None and MetricsConfig().port("backfill") is None
    assert MetricsConfig().api is True


def test_each_databases_app_gets_its_own_port() -> None:
    metrics = config_with({"stream_port": 9464, "backfill_port": 9500, "host": "127.0.0.1"}, databases=3).metrics
    assert [metrics.port("stream", i) for i in range(3)] == [9464, 9465, 9466]
    assert metrics.port("backfill", 2) == 9502 and metrics.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("metrics", "path", "reason"),
    [
        ({"stream_port": 0}, "metrics.stream_port", "must be between 1 and"),
        ({"stream_port": "9464"}, "metrics.stream_port", "expected an integer"),
        ({"backfill_port": 70000}, "metrics.backfill_port", "must be between 1 and"),
        ({"stream_port": 9464, "backfill_port": 9464}, "metrics.backfill_port", "must differ"),
        ({"api": "yes"}, "metrics.api", "expected true or false"),
        ({"port": 9464}, "metrics.port", "unknown key"),
        ([9464], "metrics", "expected a mapping"),
    ],
)
def test_bad_metrics_options_are_clear_errors(metrics: Any, path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_with(metrics)
    assert caught.value.path == path and reason in caught.value.reason, str(caught.value)


def test_a_weighted_histogram_counts_each_value_as_often_as_it_was_seen() -> None:
    registry = CollectorRegistry()
    histogram = WeightedHistogram("sequin_test_seconds", "test", ["database"], [0.1, 1.0, 10.0])
    registry.register(histogram)
    histogram.labels("idle")
    histogram.observe_many(("db",), [0.05, 0.1, 0.5, 5.0, 50.0], [1, 2, 3, 4, 5])
    histogram.observe_many(("db",), [1.0], None)
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    samples = {(s.name, s.labels.get("database"), s.labels.get("le")): s.value for s in families[0].samples}
    assert [samples[("sequin_test_seconds_bucket", "db", le)] for le in ("0.1", "1.0", "10.0", "+Inf")] == [
        3,
        7,
        11,
        16,
    ]
    assert samples[("sequin_test_seconds_count", "db", None)] == 16
    assert samples[("sequin_test_seconds_sum", "db", None)] == pytest.approx(0.05 + 0.2 + 1.5 + 20 + 250 + 1.0)
    assert samples[("sequin_test_seconds_count", "idle", None)] == 0


def test_the_driver_adds_a_batchs_reports_and_a_scrape_survives_a_source_and_store_that_are_down() -> None:
    metrics = StreamMetrics(config_with({"stream_port": 9464}), "db0")
    finished = 1_800_000_000_000.0
    metrics.record_batch(BatchReport(0, 0.01, [0, 0], [0, 0]))  # an empty batch counts nowhere
    metrics.record_batch(BatchReport(30, 0.5, [30, 27], [0, 3], [finished - 200, finished - 2000], [10, 20], finished))
    metrics.park({"b": 2})
    get = metrics.registry.get_sample_value
    assert get("sequin_messages_delivered_total", {"database": "db0", "sink": "a"}) == 30
    assert get("sequin_messages_delivered_total", {"database": "db0", "sink": "b"}) == 27
    assert get("sequin_messages_parked_total", {"database": "db0", "sink": "b"}) == 5
    assert get("sequin_changes_total", {"database": "db0"}) == 30
    assert get("sequin_batch_rows_count", {"database": "db0"}) == 1
    assert get("sequin_batch_duration_seconds_sum", {"database": "db0"}) == 0.5
    assert get("sequin_commit_to_durable_seconds_count", {"database": "db0"}) == 30
    assert get("sequin_commit_to_durable_seconds_sum", {"database": "db0"}) == pytest.approx(10 * 0.2 + 20 * 2.0)
    assert get("sequin_commit_to_durable_seconds_bucket", {"database": "db0", "le": "0.25"}) == 10
    assert get("sequin_source_up", {"database": "db0"}) == 0
    assert get("sequin_store_up", {"database": "db0"}) == 0
    assert get("sequin_slot_lag_bytes", {"database": "db0", "slot": "sequin_slot"}) is None


def test_a_tasks_commit_times_are_counted_per_10_ms() -> None:
    times = CommitTimes()
    times.add(
        pa.record_batch({"commit_timestamp": ["2026-11-26T12:00:00.123456Z", "2026-11-26T12:00:00.129999Z", None]})
    )
    times.add(pa.record_batch({"commit_timestamp": ["2026-11-26T12:00:01.000001Z", "not a timestamp"]}))
    millis, counts = times.report()
    assert dict(zip(millis, counts)) == {1795694400120: 2, 1795694401000: 1}
    assert CommitTimes().report() == ([], [])


def test_the_dashboard_queries_only_metrics_the_metrics_page_lists() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    names = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in queried_names(queries)}
    assert names - documented_names() == set()
