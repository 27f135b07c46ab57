"""``SequinReplicationOperator`` supervising the real stream app (spark-submit, local mode, real Postgres).

The operator runs in a thread of the test, as it would in a worker; the test crashes the app
under it and checks that it is restarted and that no committed change is lost.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from airflow.sdk.exceptions import AirflowException

from devtools.stream_process import streaming_status, wait_for
from sequin_provider import store
from sequin_provider.operators.replication import SequinReplicationOperator
from sequin_provider.spark.local_checkpoint import driver_classpath
from tests.support.airflow import OperatorThread, lock_is_free, no_process_left, sequin_connection
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: kv_sink
    tables: [kv]
    destination: {{type: sequin_stream}}
    {extra}
stream:
  checkpoint_location: {ckpt}
"""


@pytest.fixture
def setup(dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``kv`` table, and a factory of configs + connections for it."""
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v text NOT NULL)")
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))

    def configure(extra: str = "") -> Path:
        config = write_config(
            tmp_path / "sequin.yaml", CONFIG.format(dsn=dsn, db=dbname, extra=extra, ckpt=tmp_path / "ckpt")
        )
        monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_DEFAULT", sequin_connection(dsn, config_path=str(config)))
        return config

    return configure


def app_started_at(dsn: str) -> datetime | None:
    with psycopg.connect(dsn) as conn:
        if not store.schema_version(conn, "sequin"):
            return None
        rows = [r for r in store.read_status(conn, "sequin") if r["database"] == "app"]
    return rows[0]["app_started_at"] if rows else None


def streaming_since(dsn: str, after: datetime | None) -> datetime | None:
    """The app's start time once an app started after ``after`` has completed a micro-batch."""
    row = streaming_status(dsn, database="app", after=after)
    return row["app_started_at"] if row else None


def write(dsn: str, ids: range, value: str) -> None:
    """Insert ``ids`` (a transaction per 10 rows)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(ids.start, ids.stop, 10):
            with conn.transaction():
                conn.execute(
                    "INSERT INTO kv SELECT g, %s FROM generate_series(%s::int, %s::int) g",
                    (value, start, min(start + 9, ids.stop - 1)),
                )


def test_a_crashed_stream_app_is_restarted_and_no_change_is_lost(setup: Any, dsn: str) -> None:
    setup()
    op = SequinReplicationOperator(
        task_id="supervise",
        stall_timeout=120,
        start_timeout=600,
        max_restarts=3,
        restart_backoff=0.5,
        poll_interval=0.5,
        driver_memory="1g",
    )
    running = OperatorThread(op).start()
    outcome = running.outcome
    try:
        first = wait_for(
            lambda: outcome.get("error") or streaming_since(dsn, None), 600, what="the supervised app to stream"
        )
        assert not isinstance(first, BaseException), first
        write(dsn, range(1, 101), "before")
        wait_for(lambda: len(sink_messages(dsn, "kv_sink")) >= 100, 300, what="the first changes in the sink")

        crashed = op.current_run
        assert crashed is not None and crashed.pid is not None
        # spark-submit's driver JVM has the checkpoint jar on its class path (operators.spark_submit.submit_conf)
        submitted = psutil.Process(crashed.pid)
        jvms = [p for p in [submitted, *submitted.children(recursive=True)] if p.name() == "java"]
        assert jvms and driver_classpath() and driver_classpath() in " ".join(jvms[0].cmdline())
        os.killpg(crashed.pid, signal.SIGKILL)  # the whole app dies at once: JVM, driver, Python workers
        write(dsn, range(101, 201), "while down")  # committed while no app runs

        second = wait_for(
            lambda: outcome.get("error") or streaming_since(dsn, first), 600, what="the restarted app to stream"
        )
        assert not isinstance(second, BaseException), second
        assert op.restarts == 1 and len(op.runs) == 2 and crashed.finished
        write(dsn, range(201, 301), "after")
        execute(dsn, "UPDATE kv SET v = 'updated' WHERE id % 50 = 0")

        def all_there() -> list[dict[str, Any]] | None:
            messages = sink_messages(dsn, "kv_sink")
            return messages if len(messages) >= 306 else None

        messages = wait_for(all_there, 300, what="every change in the sink")
    finally:
        running.stop()
    inserts = [m["record"]["id"] for m in messages if m["action"] == "insert"]
    assert sorted(set(inserts)) == list(range(1, 301))  # nothing lost (a replayed batch may repeat: at least once)
    updates = [m for m in messages if m["action"] == "update"]
    assert sorted(m["record"]["id"] for m in updates) == list(range(50, 301, 50))
    for update in updates:  # per row: the insert before the update
        row = [m["action"] for m in messages if m["record"]["id"] == update["record"]["id"]]
        assert row.index("insert") < row.index("update")
    assert "the supervisor was stopped" in str(outcome.get("error"))
    assert all(no_process_left(run.pid) for run in op.runs)
    assert lock_is_free(dsn)


def test_an_app_that_fails_at_every_start_fails_the_task_after_bounded_restarts(setup: Any, dsn: str) -> None:
    setup("filter: \"record.v ==== 'x'\"")  # valid YAML, invalid Spark SQL: the app stops at start with exit 2
    op = SequinReplicationOperator(
        task_id="supervise", max_restarts=2, restart_backoff=0.2, poll_interval=0.2, driver_memory="1g"
    )
    with pytest.raises(AirflowException) as failed:
        op.execute(context={})
    message = str(failed.value)
    assert "giving up after 2 consecutive restarts" in message
    assert "exited (spark-submit exited with 2" in message and "sinks[0].filter: invalid SQL" in message
    assert len(op.runs) == 3 and op.restarts == 2
    assert all(run.finished and run.returncode == 2 for run in op.runs)
    assert app_started_at(dsn) is None  # never got as far as streaming
    assert lock_is_free(dsn)
