"""The apps against a real Spark standalone cluster (``spark://``), not local mode.

A master and two workers are started from pyspark's own jars on loopback (the same daemons the
docker-compose file runs in containers, ``devtools.spark_cluster``). ``SequinBackfillOperator``
submits ``spark_apps/backfill.py`` in client mode: the driver runs here, the range readers run in
executors that the workers start. The stream app runs the short chaos round with its executors on
both workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.spark_cluster import SparkCluster
from devtools.stream_process import streaming_status, wait_for
from sequin_provider import store
from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.replication import SequinReplicationOperator
from tests.support.airflow import OperatorThread, lock_is_free, no_process_left, sequin_connection
from tests.support.chaos.harness import SHORT, ChaosRound, assert_clean
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

ROWS = 2000


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A cluster whose master is starting (the test finishes it while its stream app starts)."""
    cluster = SparkCluster(
        tmp_path_factory.mktemp("spark_cluster"), workers=2, cores=1, memory="1536m", hide_from_last_worker=True
    )
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_backfill_operator_runs_on_a_spark_standalone_master(
    spark_cluster: SparkCluster, dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    execute(
        dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL)",
        f"INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, {ROWS}) g",
        "ANALYZE items",
    )
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}, publication: {{name: pub_{dbname}}},
                     heartbeat_interval: 1s}}]
        sinks: [{{name: items_sink, tables: [items], destination: {{type: sequin_stream}}}}]
        stream: {{checkpoint_location: "{tmp_path / "ckpt"}"}}
        """,
    )
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_DEFAULT", sequin_connection(dsn, config_path=str(config)))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "spark://127.0.0.1", "port": spark_cluster.port}),
    )
    app = StreamApp(config, tmp_path / "stream-app.log").start()  # the stream side runs locally
    try:
        before = {app["id"] for app in (spark_cluster.wait_ready().state() or {}).get("completedapps", [])}
        app.wait_streaming(dsn)
        op = SequinBackfillOperator(task_id="backfill", sink="items_sink", table="items", max_query_ms=2000)
        backfill_id = op.execute(context={})
        reads = wait_for(
            lambda: [m for m in sink_messages(dsn, "items_sink") if m["action"] == "read"],
            60,
            what="the reads in the sink",
        )
    finally:
        app.stop()
    with psycopg.connect(dsn) as conn:
        record = store.get_backfill(conn, "sequin", int(backfill_id))
    assert (record.state, record.rows_processed) == ("completed", ROWS), record
    assert len(reads) == ROWS and sorted(m["record"]["id"] for m in reads) == list(range(1, ROWS + 1))
    ran = [a for a in (spark_cluster.state() or {}).get("completedapps", []) if a["id"] not in before]
    assert len(ran) == 1 and ran[0]["state"] == "FINISHED", ran  # the job ran on the cluster, to its end
    assert ran[0]["cores"] >= 1, ran


def stream_apps(cluster: SparkCluster, database: str) -> list[dict[str, Any]]:
    """The stream apps of ``database`` the master has seen (running or finished)."""
    state = cluster.state() or {}
    apps = [*state.get("activeapps", []), *state.get("completedapps", [])]
    return [a for a in apps if a["name"] == f"sequin-replication-{database}"]


def ready_writers(cluster: SparkCluster, app_ids: list[str]) -> dict[str, list[str]]:
    """Per worker, the writers its executors of these apps made to deliver (pipeline.log_writer_ready)."""
    found: dict[str, list[str]] = {}
    for app_id in app_ids:
        for worker, logs in cluster.executor_logs(app_id).items():
            found.setdefault(worker, [])
            for path in logs:
                found[worker] += [
                    line for line in path.read_text(errors="replace").splitlines() if "is ready on" in line
                ]
    return found


def test_the_short_chaos_round_passes_with_the_stream_app_on_a_two_worker_cluster(
    spark_cluster: SparkCluster, tmp_path: Path
) -> None:
    """The stream app's driver here, its executors on two workers, the spool a ``file://`` URI (read
    through pyarrow's filesystem API, as hdfs:// or s3:// would be): the short chaos round (kills,
    Postgres restarts, store and webhook down, a backfill) loses and reorders nothing."""
    cluster = spark_cluster.wait_ready()
    with EmbeddedPostgres() as pg:
        result = ChaosRound(
            pg,
            tmp_path / "round",
            SHORT,
            1,
            seed=11,
            app_env={"SEQUIN_SPARK_MASTER": cluster.url, "SEQUIN_SPARK_DRIVER_MEMORY": "1g"},
            spool_location=f"file://{tmp_path / 'shared-spool'}",
        ).run()
    print("\n".join(result.lines()))
    apps = stream_apps(cluster, "app")
    writers = ready_writers(cluster, [a["id"] for a in apps])
    for worker, lines in writers.items():
        print(f"{worker}: {len(lines)} writers, e.g. {lines[:1]}")
    assert_clean(result, SHORT)
    assert len(apps) >= result.app_starts, apps  # every app of the round ran on the cluster
    assert all(lines for lines in writers.values()) and len(writers) == 2, writers  # delivery on both workers
    log = (tmp_path / "round" / "stream-app.log").read_text()
    assert "readable by the executors of spark://" in log


def test_a_spool_that_one_worker_cannot_read_stops_the_stream_app_at_start_with_the_reason(
    spark_cluster: SparkCluster, dsn: str, dbname: str, tmp_path: Path
) -> None:
    """The spool in a folder the second worker does not see (as if on another host): the app stops
    before it reads the slot, exit code 2, the reason in its log and in the status row."""
    cluster = spark_cluster.wait_ready()
    if cluster.hidden is None:
        pytest.skip("mount namespaces are not allowed here (unshare -m): no folder can be hidden from a worker")
    execute(dsn, "CREATE TABLE items (id int PRIMARY KEY)")
    spool = cluster.hidden / "spool"
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}, publication: {{name: pub_{dbname}}}}}]
        sinks: [{{name: items_sink, tables: [items], destination: {{type: sequin_stream}}}}]
        stream: {{checkpoint_location: "{tmp_path / "ckpt"}", spool_location: "{spool}"}}
        """,
    )
    app = StreamApp(config, tmp_path / "stream-app.log", {"SEQUIN_SPARK_MASTER": cluster.url}).start()
    assert app.proc is not None
    code = app.proc.wait(timeout=240)
    log = (tmp_path / "stream-app.log").read_text()
    assert code == 2, log
    assert f"executors cannot read the spool at {spool}/app:" in log and "FileNotFoundError" in log, log
    assert "set stream.spool_location to a folder every executor reaches" in log
    assert "streaming database" not in log  # it never started the query
    with psycopg.connect(dsn) as conn:
        (status,) = store.read_status(conn, "sequin")
    assert status["last_error"].startswith(f"executors cannot read the spool at {spool}/app")


def test_the_replication_operator_supervises_the_stream_app_on_the_cluster_in_client_mode(
    spark_cluster: SparkCluster, dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SequinReplicationOperator`` with ``spark_default`` at the standalone master: spark-submit in
    client mode, the driver in the task's process tree, the executors on the workers; stopping the
    task stops the app and frees the cluster."""
    cluster = spark_cluster.wait_ready()
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v text NOT NULL)")
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}, publication: {{name: pub_{dbname}}},
                     heartbeat_interval: 1s}}]
        sinks: [{{name: kv_sink, tables: [kv], destination: {{type: sequin_stream}}}}]
        stream: {{checkpoint_location: "{tmp_path / "ckpt"}"}}
        """,
    )
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_DEFAULT", sequin_connection(dsn, config_path=str(config)))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "spark://127.0.0.1", "port": cluster.port}),
    )
    op = SequinReplicationOperator(
        task_id="supervise", stall_timeout=120, start_timeout=600, max_restarts=1, poll_interval=0.5, driver_memory="1g"
    )
    running_op = OperatorThread(op).start()
    outcome = running_op.outcome
    try:
        wait_for(lambda: outcome.get("error") or streaming_status(dsn, database="app"), 600, what="the app to stream")
        assert "error" not in outcome, outcome
        execute(
            dsn,
            "INSERT INTO kv SELECT g, 'v' || g FROM generate_series(1, 500) g",
            "UPDATE kv SET v = 'x' WHERE id <= 10",
        )
        messages = wait_for(
            lambda: (m := sink_messages(dsn, "kv_sink")) and len(m) >= 510 and m, 300, what="the changes in the sink"
        )
        running = [a for a in (cluster.state() or {}).get("activeapps", []) if a["name"] == "sequin-replication-app"]
    finally:
        running_op.stop()
    assert [m["record"]["id"] for m in messages if m["action"] == "insert"] == list(range(1, 501))
    assert [m["record"]["id"] for m in messages if m["action"] == "update"] == list(range(1, 11))
    assert len(running) == 1 and running[0]["cores"] == 2, running  # one app, on both workers' cores
    writers = ready_writers(cluster, [running[0]["id"]])
    assert sum(len(lines) for lines in writers.values()) >= 1, writers  # delivered from the executors
    assert "the supervisor was stopped" in str(outcome.get("error"))
    assert all(no_process_left(run.pid) for run in op.runs) and lock_is_free(dsn)
    wait_for(
        lambda: not [a for a in (cluster.state() or {}).get("activeapps", []) if a["id"] == running[0]["id"]],
        120,
        what="the app to leave the cluster",
    )
