"""``SequinBackfillOperator`` against a real Spark standalone cluster (``spark://``), not local mode.

A master and a worker are started from pyspark's own jars on loopback (the same daemons the
docker-compose file runs in containers). The operator submits ``spark_apps/backfill.py`` in client
mode: the driver runs here, the range readers run in executors that the worker starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import psycopg
import pyspark
import pytest

from devtools.embedded_postgres import free_port
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.operators.backfill import SequinBackfillOperator
from tests.support.airflow import sequin_connection
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

ROWS = 2000


class SparkCluster:
    """A Spark standalone master and one worker (2 cores, 2 GiB) on 127.0.0.1."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port, self.ui_port, self.worker_ui_port = free_port(), free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def _daemon(self, name: str, *args: str) -> None:
        home = Path(pyspark.__file__).parent
        env = {
            **os.environ,
            "SPARK_HOME": str(home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_WORKER_DIR": str(self.work / "worker"),
            "SPARK_LOG_DIR": str(self.work),
        }
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it; closed when we exit
        self.procs.append(
            subprocess.Popen(
                [str(home / "bin" / "spark-class"), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def state(self) -> dict[str, Any] | None:
        """The master's JSON status page (workers, applications), or None while it does not answer."""
        try:
            response = httpx.get(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.is_success else None  # type: ignore[no-any-return]

    def start(self) -> SparkCluster:
        """Start the master (``wait_ready`` starts the worker once the master answers)."""
        self._daemon(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui_port),
        )
        return self

    def wait_ready(self) -> SparkCluster:
        """Wait for the master, start the worker (a worker that finds no master retries only after
        5-15 s) and wait until it has registered."""
        wait_for(self.state, 180, interval=0.5, what="the Spark master")
        if len(self.procs) == 1:
            self._daemon(
                "worker",
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--webui-port",
                str(self.worker_ui_port),
                "--cores",
                "2",
                "--memory",
                "2g",
                self.url,
            )
        wait_for(
            lambda: (self.state() or {}).get("aliveworkers", 0) >= 1,
            180,
            interval=0.5,
            what="the Spark worker to register",
        )
        return self

    def stop(self) -> None:
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A cluster whose master is starting (the test finishes it while its stream app starts)."""
    cluster = SparkCluster(tmp_path_factory.mktemp("spark_cluster"))
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
