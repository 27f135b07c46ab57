"""Prometheus ``/metrics`` of the three processes after a real workload (docs/metrics.md): the stream app
and the backfill server as subprocesses with ``metrics.stream_port`` / ``metrics.backfill_port``, the pull
API in-process, a webhook endpoint on loopback, a real Postgres. Every page is parsed with Prometheus'
own parser, and the counters must equal what was delivered, exactly. Nothing is mocked.

One deployment serves every test of the module (the apps start once, about a minute on 2 cores)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres, free_port
from devtools.stream_process import BackfillServerProcess, wait_for
from sequin_provider import store, stream_queue
from sequin_provider.config import load_config
from tests.support.backfills import backfill
from tests.support.config import write_config
from tests.support.metrics import (
    dashboard_queries,
    documented_names,
    exported_names,
    family_names,
    queried_names,
    scrape,
    value,
)
from tests.support.postgres import execute, sink_messages
from tests.support.receiver import Receiver
from tests.support.stream_api import ApiServer
from tests.support.stream_app import StreamApp

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_metrics}}
    publication: {{name: pub_metrics}}
    heartbeat_interval: 1s
sinks:
  - {{name: orders_stream, tables: [orders], destination: {{type: sequin_stream, max_waiting: 1}}}}
  - {{name: orders_hook, tables: [orders], destination: {{type: webhook, url: "{hook}", batch_size: 10}}}}
  - {{name: items_stream, tables: [items], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {ckpt}
metrics:
  host: 127.0.0.1
  stream_port: {stream_port}
  backfill_port: {backfill_port}
"""
ITEMS = 1000
ORDERS = 300
UPDATED = 50
CHANGES = ORDERS + UPDATED
REFUSED_ID = 7
"""The webhook refuses every request that carries order 7's insert: it and what follows in its group are parked."""


@dataclass
class Deployment:
    dsn: str
    config: Path
    app: StreamApp
    server: BackfillServerProcess
    receiver: Receiver
    stream_url: str
    backfill_url: str


def refuse_order_7(messages: list[dict[str, Any]]) -> tuple[int, float]:
    refused = any(m["record"].get("id") == REFUSED_ID and m["action"] == "insert" for m in messages)
    return (500 if refused else 200), 0.0


def parked_count(dsn: str, sink: str) -> int:
    with psycopg.connect(dsn) as conn:
        return store.buffer_counts(conn, "sequin").get(sink, {}).get("parked", 0)


@pytest.fixture(scope="module")
def deployment(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The stream app and the backfill server up, and the workload delivered: ``CHANGES`` changes of
    ``orders`` in the stream sink and at the webhook (or parked), ``ITEMS`` rows of ``items`` to backfill."""
    dsn = pg.create_database("metrics")
    execute(
        dsn,
        "CREATE TABLE orders (id bigint PRIMARY KEY, note text)",
        "CREATE TABLE items (id bigint PRIMARY KEY, name text)",
        f"INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, {ITEMS}) g",
    )
    tmp = tmp_path_factory.mktemp("metrics")
    receiver = Receiver().start()
    receiver.policy = refuse_order_7
    stream_port, backfill_port = free_port(), free_port()
    config = write_config(
        tmp / "sequin.yaml",
        CONFIG.format(
            dsn=dsn,
            hook=receiver.url,
            ckpt=tmp / "ckpt",
            stream_port=stream_port,
            backfill_port=backfill_port,
        ),
    )
    app = StreamApp(config, tmp / "app.log").start()
    server = BackfillServerProcess(config, tmp / "server.log", "--master", "local[2]")
    try:
        wait_for(lambda: "created replication slot" in app.log_tail(1_000_000) or app.check_alive(), 180, what="slot")
        server.start()  # after provisioning: the server needs the store's schema
        app.wait_streaming(dsn)
        for first in range(1, ORDERS + 1, 100):  # three transactions of 100 inserts, then one of 50 updates
            execute(dsn, f"INSERT INTO orders SELECT g, 'order ' || g FROM generate_series({first}, {first + 99}) g")
        execute(dsn, f"UPDATE orders SET note = 'updated' WHERE id <= {UPDATED}")
        wait_for(
            lambda: (
                len(sink_messages(dsn, "orders_stream")) == CHANGES
                and len(receiver.messages()) + parked_count(dsn, "orders_hook") == CHANGES
            ),
            180,
            what="the changes in the stream sink and at the webhook (or parked)",
        )
        server.wait_up()
        yield Deployment(
            dsn,
            config,
            app,
            server,
            receiver,
            f"http://127.0.0.1:{stream_port}/metrics",
            f"http://127.0.0.1:{backfill_port}/metrics",
        )
    finally:
        server.stop()
        app.stop()
        receiver.stop()


def test_the_stream_apps_metrics_count_every_message_delivered_per_sink(deployment: Deployment) -> None:
    d = deployment
    hooked = len(d.receiver.messages())
    parked = parked_count(d.dsn, "orders_hook")
    assert parked >= 2 and hooked + parked == CHANGES  # order 7's insert and update at least

    def settled() -> bool:  # the counters move once a batch is done: after the store shows it
        samples = scrape(d.stream_url)
        return value(samples, "sequin_messages_delivered_total", sink="orders_hook") == hooked and value(
            samples, "sequin_messages_delivered_total", sink="orders_stream"
        ) == float(CHANGES)

    wait_for(settled, 30, what="the stream app's counters")
    samples = scrape(d.stream_url)
    assert value(samples, "sequin_messages_delivered_total", database="app", sink="orders_stream") == CHANGES
    assert value(samples, "sequin_messages_delivered_total", sink="orders_hook") == hooked
    assert value(samples, "sequin_messages_parked_total", sink="orders_hook") == parked
    assert value(samples, "sequin_messages_parked_total", sink="orders_stream") == 0
    assert value(samples, "sequin_buffer_parked_messages", sink="orders_hook") == parked  # the store's gauge
    assert value(samples, "sequin_buffer_discarded_messages", sink="orders_hook") == 0
    # every change went through a batch (heartbeats and marks are change rows too)
    assert (value(samples, "sequin_changes_total", database="app") or 0) >= CHANGES
    latency_count = value(samples, "sequin_commit_to_durable_seconds_count", database="app") or 0
    assert latency_count >= CHANGES
    assert value(samples, "sequin_commit_to_durable_seconds_bucket", database="app", le="+Inf") == latency_count
    latency_sum = value(samples, "sequin_commit_to_durable_seconds_sum", database="app") or 0
    assert 0 < latency_sum / latency_count < 60  # seconds from commit to durable, on one machine
    batches = value(samples, "sequin_batch_rows_count", database="app") or 0
    assert batches >= 1 and value(samples, "sequin_batch_duration_seconds_count", database="app") == batches
    assert (value(samples, "sequin_batch_rows_sum", database="app") or 0) >= CHANGES
    # read at scrape time: the slot and the heartbeat
    assert value(samples, "sequin_source_up", database="app") == 1
    assert value(samples, "sequin_store_up", database="app") == 1
    assert value(samples, "sequin_slot_lag_bytes", database="app", slot="slot_metrics") is not None
    assert value(samples, "sequin_slot_active", database="app", slot="slot_metrics") == 1
    assert 0 <= (value(samples, "sequin_heartbeat_age_seconds", database="app") or -1) < 60


def test_the_pull_apis_metrics_count_receives_acks_nacks_and_429s(deployment: Deployment) -> None:
    d = deployment
    config = load_config(d.config)
    with psycopg.connect(d.dsn) as conn:
        token = stream_queue.create_token(conn, "sequin", "metrics")
    with (
        ApiServer(config) as api,
        httpx.Client(base_url=api.url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as client,
    ):
        receives = 0

        def receive(**params: Any) -> list[dict[str, Any]]:
            nonlocal receives
            response = client.post("/api/sequin_streams/orders_stream/receive", json=params)
            assert response.status_code == 200, response.text
            receives += 1
            return response.json()["data"]

        def settle(op: str, got: list[dict[str, Any]]) -> None:
            response = client.post(
                f"/api/sequin_streams/orders_stream/{op}", json={"ack_ids": [m["ack_id"] for m in got]}
            )
            assert response.status_code == 200, response.text

        first = receive(batch_size=10)
        assert len(first) == 10
        samples = scrape(f"{api.url}/metrics", client)
        assert value(samples, "sequin_stream_outstanding_messages", sink="orders_stream") == 10
        settle("nack", first)
        acked = 0
        while acked < CHANGES:
            got = receive(batch_size=100)
            assert got, f"the stream ran dry after {acked} acks"
            settle("ack", got)
            acked += len(got)
        assert receive(batch_size=100) == []

        # max_waiting 1: a second long poll while one waits is refused with 429
        waiting = threading.Thread(target=lambda: receive(batch_size=1, wait_for=3000))
        waiting.start()
        try:
            wait_for(lambda: value(scrape(f"{api.url}/metrics", client), "sequin_store_up") == 1, 10, what="a scrape")
            refused = None
            for _ in range(20):  # until the first poll is surely waiting
                refused = client.post("/api/sequin_streams/orders_stream/receive", json={"wait_for": 500})
                if refused.status_code == 429:
                    break
                receives += 1
            assert refused is not None and refused.status_code == 429, refused.text if refused else None
        finally:
            waiting.join()

        samples = scrape(f"{api.url}/metrics", client)
    labels = {"sink": "orders_stream"}
    assert value(samples, "sequin_api_messages_received_total", **labels) == CHANGES + 10
    assert value(samples, "sequin_api_messages_acked_total", **labels) == CHANGES
    assert value(samples, "sequin_api_messages_nacked_total", **labels) == 10
    assert value(samples, "sequin_api_too_many_requests_total", **labels) == 1
    assert value(samples, "sequin_api_receive_requests_total", **labels) == receives
    assert value(samples, "sequin_stream_outstanding_messages", **labels) == 0
    assert value(samples, "sequin_api_messages_received_total", sink="items_stream") == 0


def test_the_backfill_servers_metrics_count_the_rows_it_backfilled(deployment: Deployment) -> None:
    d = deployment
    samples = scrape(d.backfill_url)
    assert value(samples, "sequin_store_up", database="app") == 1
    assert value(samples, "sequin_backfill_rows_total", sink="items_stream") is None  # none yet
    recorded = backfill(d.dsn, d.config, "items_stream", "items")

    def completed() -> bool:
        d.server.check_alive()
        with psycopg.connect(d.dsn) as conn:
            return store.get_backfill(conn, "sequin", recorded.id).state == "completed"

    wait_for(completed, 180, what="the backfill")
    samples = scrape(d.backfill_url)
    labels = {"database": "app", "sink": "items_stream", "table": "public.items"}
    assert value(samples, "sequin_backfill_rows_total", **labels) == ITEMS
    assert value(samples, "sequin_backfills", **labels, state="completed") == 1
    assert len([m for m in sink_messages(d.dsn, "items_stream") if m["action"] == "read"]) == ITEMS


def test_every_metric_the_dashboard_queries_is_exported_and_every_exported_one_documented(
    deployment: Deployment,
) -> None:
    d = deployment
    config = load_config(d.config)
    with ApiServer(config) as api:
        pages = [d.stream_url, d.backfill_url, f"{api.url}/metrics"]
        exported = set().union(*(exported_names(url) for url in pages))
        documented = set().union(*(family_names(url) for url in pages))
    assert queried_names(dashboard_queries()) - exported == set(), "the dashboard queries metrics nobody exports"
    assert documented == documented_names(), "docs/metrics.md lists exactly the exported metrics"
