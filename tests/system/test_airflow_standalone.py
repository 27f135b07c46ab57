"""End to end on ``airflow standalone``: a ``sequin_backfill`` run triggered through Airflow's REST
API with a conf (as a script, or the UI's trigger form, does) delivers the table's rows, and a
consumer reads them through the Sequin Stream API that the provider's plugin mounts in Airflow's
API server. Everything is real: Airflow's scheduler, DAG processor, triggerer and API server, the
LocalExecutor, spark-submit in local mode, Postgres, HTTP.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import psycopg
import pytest

from devtools.airflow_standalone import AirflowApiError, AirflowStandalone, airflow_env
from devtools.embedded_postgres import EmbeddedPostgres, free_port
from sequin_provider import store, stream_queue
from tests.support.config import write_config
from tests.support.postgres import execute
from tests.support.stream_app import StreamApp

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_standalone}}
    publication: {{name: pub_standalone}}
    heartbeat_interval: 1s
sinks:
  - {{name: items_sink, tables: [items], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {ckpt}
"""
ROWS = 500


class Deployment:
    """What the tests use: the database, a stream API token, and the running Airflow."""

    def __init__(self, dsn: str, token: str, airflow: AirflowStandalone) -> None:
        self.dsn, self.token, self.airflow = dsn, token, airflow


@pytest.fixture(scope="module")
def deployment(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A table, the stream app streaming it, and ``airflow standalone`` configured for both."""
    dsn = pg.create_database("standalone_e2e")
    execute(
        dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL)",
        f"INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, {ROWS}) g",
        "ANALYZE items",
    )
    tmp = tmp_path_factory.mktemp("standalone")
    config = write_config(tmp / "sequin.yaml", CONFIG.format(dsn=dsn, ckpt=tmp / "ckpt"))
    app = StreamApp(config, tmp / "stream-app.log").start()
    port = free_port()
    home = tmp / "airflow"
    airflow = AirflowStandalone(
        home,
        airflow_env(
            home,
            dsn,
            config,
            port=port,
            database="app",
            slot="slot_standalone",
            metadata_dsn=pg.create_database("standalone_airflow"),
        ),
        port=port,
        log_path=tmp / "airflow.log",
    )
    try:
        airflow.start()  # both start at once: neither waits for the other until a backfill runs
        app.wait_streaming(dsn)
        with psycopg.connect(dsn) as conn:
            token = stream_queue.create_token(conn, "sequin", "standalone-test")
            conn.commit()
        airflow.wait_ready()
        yield Deployment(dsn, token, airflow)
    finally:
        airflow.stop()
        app.stop()


def receive_all(base_url: str, token: str, sink: str) -> list[dict[str, Any]]:
    """Drain ``sink`` with receive + ack, as a consumer would; the messages in the order received."""
    got: list[dict[str, Any]] = []
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        while True:
            response = client.post(f"/api/sequin_streams/{sink}/receive", json={"batch_size": 100})
            assert response.status_code == 200, response.text
            batch = response.json()["data"]
            if not batch:
                return got
            got.extend(m["data"] for m in batch)
            acked = client.post(f"/api/sequin_streams/{sink}/ack", json={"ack_ids": [m["ack_id"] for m in batch]})
            assert acked.status_code == 200, acked.text


def test_backfill_triggered_over_the_rest_api_is_read_through_the_plugin(deployment: Deployment) -> None:
    airflow = deployment.airflow
    conf = {"sink": "items_sink", "table": "items", "max_query_ms": 2000}
    run_id = airflow.trigger("sequin_backfill", conf)
    run = airflow.wait_run("sequin_backfill", run_id)
    assert run["state"] == "success", f"{airflow.log_tail(20000)}\n{airflow.task_logs('sequin_backfill', run_id)}"
    assert run["conf"] == conf
    task = airflow.task_instances("sequin_backfill", run_id)["backfill"]
    assert task["state"] == "success"
    with psycopg.connect(deployment.dsn) as conn:
        record = store.list_backfills(conn, "sequin", "items_sink")[0]
    assert (record.state, record.table_schema, record.table_name, record.rows_processed, record.max_query_ms) == (
        "completed",
        "public",
        "items",
        ROWS,
        2000,
    )

    plugin = f"{airflow.base_url}/sequin"  # the Sequin Stream API inside Airflow's API server
    # the first request to the plugin may take seconds on a busy machine (httpx's default timeout is 5 s)
    assert httpx.post(f"{plugin}/api/sequin_streams/items_sink/receive", timeout=60).status_code == 401
    messages = receive_all(plugin, deployment.token, "items_sink")
    reads = [m for m in messages if m["action"] == "read"]
    assert len(reads) == len(messages) == ROWS  # every row exactly once, nothing else
    assert sorted(m["record"]["id"] for m in reads) == list(range(1, ROWS + 1))
    assert all(m["record"]["name"] == f"item {m['record']['id']}" and m["changes"] is None for m in reads)
    assert {m["metadata"]["idempotency_key"].split(":")[1] for m in reads} == {str(record.id)}
    assert receive_all(plugin, deployment.token, "items_sink") == []  # all acked


def test_a_conf_outside_the_form_is_refused_and_starts_nothing(deployment: Deployment) -> None:
    airflow = deployment.airflow
    with psycopg.connect(deployment.dsn) as conn:
        before = len(store.list_backfills(conn, "sequin"))
    with pytest.raises(AirflowApiError, match="HTTP 400"):
        airflow.trigger("sequin_backfill", {"sink": "items_sink", "table": "items", "kind": "sideways"})
    with pytest.raises(AirflowApiError, match="HTTP 400"):
        airflow.trigger("sequin_backfill", {"sink": "items_sink", "table": "items", "max_query_ms": "soon"})
    with psycopg.connect(deployment.dsn) as conn:
        assert len(store.list_backfills(conn, "sequin")) == before
