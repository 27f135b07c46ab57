"""The DAGs: they import cleanly without I/O, have the documented ids, schedules and params, and
``sequin_backfill`` runs end to end under ``dag.test()`` (real Postgres, the stream app, Spark).

``dag.test()`` needs a migrated metadata database and reads Airflow's configuration when Airflow
is first imported; this test process has long imported it with the default ``AIRFLOW_HOME``. So
``dag.test()`` runs in another interpreter with ``AIRFLOW_HOME`` (and a SQLite metadata database
migrated once per session) in a temporary folder; the connections reach it as
``AIRFLOW_CONN_*`` environment variables, set with ``monkeypatch``. One such interpreter runs the
module's DAG runs one after another (importing Airflow and starting ``dag.test()``'s in-process
API cost about 15 s each time): each run gets the test's environment and working folder, parses
the DAGs again, and writes its output to the test's log.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.backfill import server_lock
from sequin_provider.config import load_config
from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.backfill_server import SequinBackfillServerOperator
from sequin_provider.operators.buffer import SequinBufferRetryOperator
from sequin_provider.operators.replay import SequinReplayOperator
from sequin_provider.operators.replication import SequinReplicationOperator
from sequin_provider.pgoutput import int_to_lsn, lsn_to_int
from sequin_provider.provisioning import initialize
from sequin_provider.sensors.sequin import ParkedMessagesSensor, ReplicationSlotLagSensor, StreamHeartbeatSensor
from tests.support.airflow import Webhook, no_process_left, sequin_connection
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

ROOT = Path(__file__).resolve().parents[3]
DAGS = ROOT / "dags"
DAG_IDS = {
    "sequin_backfill",
    "sequin_backfill_server",
    "sequin_replay",
    "sequin_replication",
    "sequin_monitoring",
    "sequin_buffer_retry",
    "sequin_freshness",
    "sequin_downstream_example",
}

RUNNER = """
import json, os, sys, traceback
from airflow.dag_processing.dagbag import DagBag
from airflow.models.connection import Connection
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session

replies = os.fdopen(os.dup(1), "w", buffering=1)  # stdout is each run's log: answers go here
idle = os.dup(2)  # this runner's own log, between runs
os.dup2(idle, 1)
for line in sys.stdin:
    request = json.loads(line)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    with open(request["log"], "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        if request["connections"]:
            with create_session() as session:
                for spec in request["connections"]:
                    session.query(Connection).filter(Connection.conn_id == spec["conn_id"]).delete()
                    session.add(Connection(**spec))
        bag = DagBag(dag_folder=request["dags"])
        assert not bag.import_errors, bag.import_errors
        run = bag.dags[request["dag_id"]].test(run_conf=request["conf"])
        tasks = {}
        with create_session() as session:
            for ti in run.get_task_instances(session=session):
                xcom = session.query(XComModel.value).filter_by(dag_id=ti.dag_id, run_id=ti.run_id,
                                                                task_id=ti.task_id, key="return_value").scalar()
                tasks[ti.task_id] = {"state": str(ti.state), "xcom": xcom}
        result = {"state": str(run.state), "run_id": run.run_id, "tasks": tasks}
        if request.get("schedule"):
            # what the scheduler's loop does next: create the runs of the DAGs the asset events queued
            from airflow.jobs.job import Job
            from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
            from airflow.models.dagrun import DagRun
            from airflow.utils.sqlalchemy import prohibit_commit
            with create_session() as session:
                with prohibit_commit(session) as guard:
                    SchedulerJobRunner(job=Job())._create_dagruns_for_dags(guard, session)
            with create_session() as session:
                result["scheduled"] = [
                    {"run_id": r.run_id, "run_type": str(r.run_type), "state": str(r.state),
                     "events": [e.extra for e in r.consumed_asset_events]}
                    for r in session.query(DagRun).filter(DagRun.dag_id == request["schedule"])
                ]
    except BaseException as exc:
        traceback.print_exc()
        result = {"error": repr(exc)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(idle, 1)
    os.dup2(idle, 2)
    replies.write("DAG-TEST-RESULT " + json.dumps(result, default=str) + "\\n")
"""


def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_dags_folder_imports_the_dags_with_their_schedules() -> None:
    bag = dagbag()
    assert bag.import_errors == {}
    assert set(bag.dag_ids) == DAG_IDS
    schedules = {dag_id: bag.dags[dag_id].schedule for dag_id in DAG_IDS - {"sequin_downstream_example"}}
    assert schedules == {
        "sequin_backfill": None,
        "sequin_replay": "@daily",
        "sequin_replication": "@continuous",
        "sequin_backfill_server": "@continuous",
        "sequin_monitoring": "*/5 * * * *",
        "sequin_buffer_retry": "* * * * *",
        "sequin_freshness": "*/5 * * * *",
    }
    (asset,) = bag.dags["sequin_downstream_example"].schedule  # scheduled on one sink table's asset
    assert (asset.name, asset.uri, asset.group) == (
        "sequin:app/public.orders@orders",
        "sequin://app/public.orders?sink=orders",
        "sequin",
    )
    assert asset.extra == {"database": "app", "table": "public.orders", "sink": "orders"}
    for dag_id in DAG_IDS - {"sequin_backfill", "sequin_downstream_example"}:
        assert bag.dags[dag_id].max_active_runs == 1 and not bag.dags[dag_id].catchup, dag_id


def test_backfill_dag_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEQUIN_CONFIG", raising=False)  # the sink and table fields are free text
    dag = dagbag().dags["sequin_backfill"]
    params = {name: dag.params.get_param(name) for name in dag.params}
    assert list(params) == ["sink", "table", "kind", "sort_column", "start_position", "max_query_ms", "where"]
    assert params["sink"].schema["type"] == params["table"].schema["type"] == "string"
    assert not params["sink"].has_value and not params["table"].has_value  # required in the form
    assert params["kind"].value == "full" and params["kind"].schema["enum"] == ["full", "partial"]
    assert params["sort_column"].value is None and params["start_position"].value is None
    assert params["where"].value is None and params["where"].schema["type"] == ["null", "string"]  # optional
    assert (
        params["max_query_ms"].value,
        params["max_query_ms"].schema["minimum"],
        params["max_query_ms"].schema["maximum"],
    ) == (5000, 1, 600000)
    with pytest.raises(Exception, match="600001"):
        params["max_query_ms"].resolve(600001)
    with pytest.raises(Exception, match="sideways"):
        params["kind"].resolve("sideways")
    (task,) = dag.tasks
    assert isinstance(task, SequinBackfillOperator) and task.deferrable
    assert dag.render_template_as_native_obj  # unset form fields reach the operator as None


def test_scheduled_dags_use_the_provider_operators_and_sensors() -> None:
    bag = dagbag()
    tasks = bag.dags["sequin_replay"].task_dict
    replay, changes = tasks["replay"], tasks["replay_changes"]
    assert isinstance(replay, SequinBackfillOperator) and replay.kind == "partial"
    assert isinstance(changes, SequinReplayOperator) and set(tasks["mode"].downstream_task_ids) == set(tasks) - {"mode"}
    assert "data_interval_start" in replay.start_position
    (supervisor,) = bag.dags["sequin_replication"].tasks
    assert isinstance(supervisor, SequinReplicationOperator) and supervisor.on_failure_callback
    (retry,) = bag.dags["sequin_buffer_retry"].tasks
    assert isinstance(retry, SequinBufferRetryOperator)
    sensors = {t.task_id: t for t in bag.dags["sequin_monitoring"].tasks}
    assert {type(t) for t in sensors.values()} == {
        ReplicationSlotLagSensor,
        StreamHeartbeatSensor,
        ParkedMessagesSensor,
    }
    for sensor in sensors.values():
        assert sensor.deferrable and sensor.fire_when == "within" and not sensor.soft_fail
        assert sensor.timeout < 300 and sensor.on_failure_callback  # judged and alerted within the 5-minute slot


class Variables:
    """``var.value`` of a template context, with the given Variables set."""

    def __init__(self, **values: str) -> None:
        self.values = values

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)


def render(dag: Any, task: Any, **context: Any) -> Any:
    """Render ``task``'s templates as a run of ``dag`` would (params, Variables, data interval)."""
    full = {
        "params": {name: dag.params[name] for name in dag.params},
        "var": {"value": Variables()},
        "data_interval_start": None,
        **context,
    }
    task.render_template_fields(full, jinja_env=dag.get_template_env())
    return task


def test_replay_renders_a_partial_backfill_from_the_data_interval() -> None:

    dag = dagbag().dags["sequin_replay"]
    task = dag.task_dict["replay"]
    render(
        dag,
        task,
        var={"value": Variables(sequin_replay_sink="kv_sink")},
        data_interval_start=datetime(2025, 3, 1, tzinfo=timezone.utc),
    )
    assert task.request() == {
        "sink": "kv_sink",
        "table": "public.orders",
        "sort_column": "updated_at",
        "start_position": "2025-03-01T00:00:00+00:00",
        "max_query_ms": 5000,
        "where": None,
    }
    manual = dagbag().dags["sequin_replay"].task_dict["replay"]  # no data interval, no start position: a clear error
    with pytest.raises(Exception, match="a partial backfill needs a sort column and a start position"):
        render(dag, manual, params={"sink": "s", "table": "t", "sort_column": "at", "start_position": None}).request()


def test_replay_in_changes_mode_renders_the_data_interval_as_the_range() -> None:

    dag = dagbag().dags["sequin_replay"]
    task = render(
        dag,
        dag.task_dict["replay_changes"],
        params={**{name: dag.params[name] for name in dag.params}, "mode": "changes", "where": "action = 'delete'"},
        data_interval_start=datetime(2025, 3, 1, tzinfo=timezone.utc),
        data_interval_end=datetime(2025, 3, 2, tzinfo=timezone.utc),
    )
    assert (task.source, task.sink, task.tables, task.since, task.until, task.where) == (
        "changes",
        "orders",
        "public.orders",
        "2025-03-01T00:00:00+00:00",
        "2025-03-02T00:00:00+00:00",
        "action = 'delete'",
    )
    with pytest.raises(Exception, match="sideways"):
        dag.params.get_param("mode").resolve("sideways")


def test_backfill_form_condition_renders_into_the_request() -> None:
    dag = dagbag().dags["sequin_backfill"]
    (task,) = dag.tasks
    params = {"sink": "s", "table": "t", "kind": "full", "sort_column": None, "start_position": None}
    context = {"params": {**params, "max_query_ms": 5000, "where": "status = 'paid'"}}
    task.render_template_fields(context, jinja_env=dag.get_template_env())  # the sink and table have no default
    assert task.request()["where"] == "status = 'paid'"


def test_monitoring_thresholds_render_into_the_triggers() -> None:
    dag = dagbag().dags["sequin_monitoring"]
    sensors = {t.task_id: render(dag, t, var={"value": Variables(sequin_max_parked="5")}) for t in dag.tasks}
    lag = sensors["slot_lag"].build_trigger(None)
    assert (lag.slot, lag.threshold_bytes, lag.fire_when) == ("sequin_slot", 1 << 30, "within")
    heartbeat = sensors["stream_heartbeat"].build_trigger(None)
    assert (heartbeat.database, heartbeat.max_age_seconds) == ("app", 120.0)
    assert sensors["parked_messages"].build_trigger(None).threshold == 5


def forbid_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Postgres, the network, the config loader, connections and Variables fail the test."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"I/O at DAG parse time: {args!r}")

    from airflow.sdk import BaseHook, Variable

    import sequin_provider.config

    monkeypatch.setattr(psycopg, "connect", forbidden)
    monkeypatch.setattr(socket.socket, "connect", forbidden)
    monkeypatch.setattr(sequin_provider.config, "load_config", forbidden)
    monkeypatch.setattr(BaseHook, "get_connection", classmethod(forbidden))
    monkeypatch.setattr(Variable, "get", staticmethod(forbidden))


def test_dag_files_do_no_io_at_parse_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Parsing must not touch Postgres, the network, the config file, connections or Variables."""
    forbid_io(monkeypatch)
    monkeypatch.setenv("SEQUIN_CONFIG", str(tmp_path / "missing.yaml"))
    bag = dagbag()
    assert bag.import_errors == {} and set(bag.dag_ids) == DAG_IDS


FORM_CONFIG = """
databases: [{name: app, conn_id: never_looked_up}]
sinks:
  - {name: orders, tables: [orders, {name: billing.invoices}], destination: {type: sequin_stream}}
  - {name: audit, tables: [public.orders], destination: {type: webhook, url: "${UNSET_URL}"}}
"""


def form_fields(monkeypatch: pytest.MonkeyPatch, config: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON schemas of ``sequin_backfill``'s sink and table fields with ``SEQUIN_CONFIG=config``,
    parsed with every other I/O forbidden."""
    monkeypatch.setenv("SEQUIN_CONFIG", str(config))
    with monkeypatch.context() as no_io:
        forbid_io(no_io)
        bag = dagbag()
    assert bag.import_errors == {}
    params = bag.dags["sequin_backfill"].params
    return params.get_param("sink").schema, params.get_param("table").schema


def test_backfill_form_offers_the_configured_sinks_and_tables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A small readable ``$SEQUIN_CONFIG``: a drop-down of its sinks and their tables as suggestions
    (no connection looked up, no environment substituted, nothing validated); the sink choices hold at
    trigger time, a table may still be given without its schema."""
    config = tmp_path / "sequin.yaml"
    config.write_text(FORM_CONFIG)
    sink, table = form_fields(monkeypatch, config)
    assert sink["enum"] == ["orders", "audit"]
    assert sink["values_display"] == {
        "orders": "orders (public.orders, billing.invoices)",
        "audit": "audit (public.orders)",
    }
    assert table["examples"] == ["public.orders", "billing.invoices"] and "enum" not in table
    params = dagbag().dags["sequin_backfill"].params
    assert params.get_param("sink").resolve("audit") == "audit"
    assert params.get_param("table").resolve("orders") == "orders"  # suggestions: public. may be left out
    with pytest.raises(Exception, match="nope"):
        params.get_param("sink").resolve("nope")


@pytest.mark.parametrize("kind", ["missing", "fifo", "too large", "malformed", "not a config"])
def test_backfill_form_falls_back_to_free_text(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str) -> None:
    """A ``$SEQUIN_CONFIG`` that is missing, a FIFO (reading it would hang), over 1 MB, malformed or
    of another shape: the sink and table fields are free text, and parsing does not wait."""
    config = tmp_path / "sequin.yaml"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "too large":
        config.write_text(FORM_CONFIG + "#" * (1 << 20))
    elif kind == "malformed":
        config.write_text("sinks: [unclosed")
    elif kind == "not a config":
        config.write_text("sinks: {orders: x}")
    started = time.monotonic()
    sink, table = form_fields(monkeypatch, config)
    assert time.monotonic() - started < 60
    for field in (sink, table):
        assert field["type"] == "string" and not {"enum", "values_display", "examples"} & set(field)


# -- dag.test() --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def airflow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``AIRFLOW_HOME`` in a temporary folder with a migrated SQLite metadata database."""
    home = tmp_path_factory.mktemp("airflow_home")
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",  # asset events queue the DAGs scheduled on them
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return env


class DagRunner:
    """The interpreter that runs the module's ``dag.test()`` runs (``RUNNER``), started when first needed
    and again after a run that did not answer; its own output goes to ``log``."""

    def __init__(self, airflow_env: dict[str, str], log: Path) -> None:
        self.airflow_env = airflow_env
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DagRunner:
        """Start the interpreter unless it runs (it imports Airflow, then waits for runs)."""
        if self.proc is None or self.proc.poll() is not None:
            with open(self.log, "ab") as own_log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", RUNNER],
                    env={**os.environ, **self.airflow_env},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=own_log,
                )
        return self

    def run(
        self,
        dag_id: str,
        conf: dict[str, Any],
        log: Path,
        dags: Path = DAGS,
        connections: list[dict[str, Any]] | None = None,
        timeout: float = 1200.0,
        schedule: str | None = None,
    ) -> dict[str, Any]:
        """``dag.test(run_conf=conf)`` of a DAG in ``dags`` with this process's environment, in ``log``'s
        folder, after storing ``connections`` (``Connection`` fields) in the metadata database; returns
        the run's and tasks' states and XComs."""
        self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        request = {
            "dags": str(dags),
            "dag_id": dag_id,
            "conf": conf,
            "log": str(log),
            "cwd": str(log.parent),
            "connections": connections or [],
            "schedule": schedule,
            "env": {**os.environ, **self.airflow_env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)},
        }
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        answer = self.proc.stdout.readline().decode() if ready else ""
        if not answer.startswith("DAG-TEST-RESULT "):
            self.stop()
            tail = log.read_text(errors="replace")[-6000:] if log.exists() else ""
            raise AssertionError(f"dag.test gave no result (log {log}, runner log {self.log}):\n{tail}")
        result: dict[str, Any] = json.loads(answer.split(" ", 1)[1])
        assert "error" not in result, f"dag.test failed (log {log}): {result['error']}\n" + log.read_text()[-6000:]
        return result

    def stop(self) -> None:
        """End the interpreter."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def dag_runner(airflow_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagRunner]:
    """The module's ``DagRunner``, started now: it imports Airflow while the stream app starts."""
    runner = DagRunner(airflow_env, tmp_path_factory.mktemp("dag_runner") / "runner.log").start()
    yield runner
    runner.stop()


def dag_test(
    runner: DagRunner,
    dag_id: str,
    conf: dict[str, Any],
    log: Path,
    dags: Path = DAGS,
    connections: list[dict[str, Any]] | None = None,
    schedule: str | None = None,
) -> dict[str, Any]:
    """Run ``dag.test(run_conf=conf)`` (``DagRunner.run``); returns the run's and tasks' states and XComs,
    and with ``schedule`` (a DAG id) the runs of that DAG after the scheduler created those the run's
    asset events queued. Airflow reads its DAG folder once per interpreter: a run of another folder
    gets an interpreter of its own."""
    if dags == DAGS:
        return runner.run(dag_id, conf, log, dags, connections, schedule=schedule)
    own = DagRunner({**runner.airflow_env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}, log.with_suffix(".runner.log"))
    try:
        return own.run(dag_id, conf, log, dags, connections)
    finally:
        own.stop()


CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_dagtest}}
    publication: {{name: pub_dagtest}}
    heartbeat_interval: 1s
sinks:
  - {{name: items_sink, tables: [items], destination: {{type: sequin_stream}}}}
  - {{name: events_sink, tables: [events], destination: {{type: sequin_stream}}}}
  - name: items_log
    tables: [items]
    destination: {{type: postgres_table, mode: changelog, dsn: "{dsn}", table: cdc.items_log, create_table: true}}
stream:
  checkpoint_location: {ckpt}
"""


@pytest.fixture(scope="module")
def streaming_db(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A database with two tables and the stream app running for it."""
    dsn = pg.create_database("dag_test")
    execute(
        dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text)",
        "INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 3000) g",
        "CREATE TABLE events (id int PRIMARY KEY, at timestamptz)",
        "INSERT INTO events SELECT g, timestamptz '2025-01-01 00:00:00+00' + g * interval '1 hour'"
        " FROM generate_series(1, 200) g",
        "ANALYZE",
    )
    tmp = tmp_path_factory.mktemp("dag_test")
    config = write_config(tmp / "sequin.yaml", CONFIG.format(dsn=dsn, ckpt=tmp / "ckpt"))
    initialize(load_config(config))  # the changelog's table
    app = StreamApp(config, tmp / "stream-app.log").start()
    try:
        app.wait_streaming(dsn)
        yield dsn, config
    finally:
        app.stop()


@pytest.fixture
def connections(streaming_db: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    dsn, config = streaming_db
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_DEFAULT", sequin_connection(dsn, config_path=str(config)))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    return dsn, config


def backfill(dsn: str, backfill_id: int) -> store.Backfill:
    with psycopg.connect(dsn) as conn:
        return store.get_backfill(conn, "sequin", backfill_id)


def test_dag_test_full_backfill_delivers_every_row_as_a_read(
    dag_runner: DagRunner, connections: tuple[str, Path], tmp_path: Path
) -> None:
    dsn, _ = connections
    result = dag_test(dag_runner, "sequin_backfill", {"sink": "items_sink", "table": "items"}, tmp_path / "dag.log")
    assert result["state"] == "success", result
    task = result["tasks"]["backfill"]
    assert task["state"] == "success"
    final = backfill(dsn, int(task["xcom"]))
    assert (final.state, final.kind, final.rows_processed, final.max_query_ms) == ("completed", "full", 3000, 5000)
    # the task instance that asked, as a retry of it would find the backfill (dag/task/run, no map index)
    assert re.fullmatch(r"airflow:sequin_backfill/backfill/manual__[^/\[]+", final.requested_by or ""), (
        final.requested_by
    )
    reads = [m for m in sink_messages(dsn, "items_sink") if m["action"] == "read"]
    assert sorted(m["record"]["id"] for m in reads) == list(range(1, 3001))
    assert all(m["changes"] is None and m["record"]["name"] == f"item {m['record']['id']}" for m in reads)
    assert reads[0]["metadata"]["idempotency_key"].startswith(f"backfill:{final.id}:")


def test_dag_test_partial_backfill_from_the_form(
    dag_runner: DagRunner, connections: tuple[str, Path], tmp_path: Path
) -> None:
    dsn, _ = connections
    conf = {
        "sink": "events_sink",
        "table": "public.events",
        "kind": "partial",
        "sort_column": "at",
        "start_position": "2025-01-08 00:00:00+00",
        "max_query_ms": 2000,
    }
    result = dag_test(dag_runner, "sequin_backfill", conf, tmp_path / "dag.log")
    assert result["state"] == "success", result
    final = backfill(dsn, int(result["tasks"]["backfill"]["xcom"]))
    assert (final.state, final.kind, final.sort_column, final.max_query_ms) == ("completed", "partial", "at", 2000)
    reads = [m for m in sink_messages(dsn, "events_sink") if m["action"] == "read"]
    assert [m["record"]["id"] for m in reads] == list(range(168, 201))  # 2025-01-08 00:00 is id 168, in order


def test_dag_test_bad_input_fails_the_run_and_records_nothing(
    dag_runner: DagRunner, connections: tuple[str, Path], tmp_path: Path
) -> None:
    dsn, _ = connections
    with psycopg.connect(dsn) as conn:
        before = len(store.list_backfills(conn, "sequin"))
    log = tmp_path / "dag.log"
    result = dag_test(dag_runner, "sequin_backfill", {"sink": "nope", "table": "items"}, log)
    assert result["state"] == "failed" and result["tasks"]["backfill"]["state"] == "failed"
    assert "unknown sink 'nope' (configured sinks: items_sink, events_sink, items_log)" in log.read_text()
    with psycopg.connect(dsn) as conn:
        assert len(store.list_backfills(conn, "sequin")) == before


def test_dag_test_replay_in_changes_mode_delivers_the_kept_changes_again(
    dag_runner: DagRunner, connections: tuple[str, Path], tmp_path: Path
) -> None:
    dsn, _ = connections
    since = datetime.now(timezone.utc).isoformat()
    execute(dsn, "UPDATE items SET name = name || ' (renamed)' WHERE id <= 5", "DELETE FROM items WHERE id = 6")
    with psycopg.connect(dsn) as conn:
        kept = wait_for(
            lambda: (lambda rows: rows if len(rows) >= 6 else None)(
                conn.execute(
                    "SELECT commit_lsn, commit_idx, action FROM cdc.items_log WHERE commit_timestamp >= %s ORDER BY 1, 2",
                    (since,),
                ).fetchall()
            ),
            120,
            what="the changes in the changelog",
        )
    conf = {
        "mode": "changes",
        "source": "items_log",
        "sink": "items_sink",
        "table": "public.items",
        "start_position": since,
        "where": "action = 'update'",
    }
    result = dag_test(dag_runner, "sequin_replay", conf, tmp_path / "dag.log")
    assert result["state"] == "success", result
    assert result["tasks"]["replay"]["state"] == "skipped"
    task = result["tasks"]["replay_changes"]
    assert task["state"] == "success"
    summary = task["xcom"] if isinstance(task["xcom"], dict) else json.loads(task["xcom"])
    assert (summary["queued"], summary["delivered"], summary["still_parked"]) == (5, 5, 0)
    execute(dsn, "UPDATE items SET name = 'x' WHERE id = 3000")  # the stream passes the replay's mark
    replayed = wait_for(
        lambda: (
            [m for m in sink_messages(dsn, "items_sink") if m["metadata"].get("replay_id") == summary["replay_id"]]
            or None
        ),
        120,
        what="the replayed messages visible",
    )
    assert [(m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]) for m in replayed] == [
        (lsn, idx) for lsn, idx, action in kept if action == "update"
    ]
    assert [m["record"]["name"] for m in replayed] == [f"item {n} (renamed)" for n in range(1, 6)]
    # the module's other tests read every item as it was
    execute(
        dsn,
        "UPDATE items SET name = 'item ' || id WHERE id <= 5 OR id = 3000",
        "INSERT INTO items VALUES (6, 'item 6')",
    )


def test_dag_test_monitoring_alerts_on_a_lagging_slot_and_only_then(
    dag_runner: DagRunner, connections: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot nobody reads falls behind: ``slot_lag`` fails and its alert reaches the webhook; the
    healthy slot of the running stream app raises no alert at all."""
    dsn, _ = connections
    monkeypatch.setenv("SEQUIN_CHECK_TIMEOUT", "8")  # how long unhealthy may last before the alert
    monkeypatch.setenv("SEQUIN_CHECK_POKE_INTERVAL", "1")
    execute(
        dsn,
        "SELECT pg_create_logical_replication_slot('lagging_slot', 'pgoutput')",
        "CREATE TABLE ballast (id int PRIMARY KEY, pad text)",
        "INSERT INTO ballast SELECT g, repeat('x', 200) FROM generate_series(1, 2000) g",
    )  # ~0.5 MB of WAL
    checks = {"database": "app", "max_heartbeat_age": 60, "max_parked": 0}
    try:
        with Webhook() as hook:
            monkeypatch.setenv("SEQUIN_ALERT_WEBHOOK_URL", f"{hook.url}/alerts")
            healthy = dag_test(
                dag_runner,
                "sequin_monitoring",
                {**checks, "slot": "slot_dagtest", "max_lag_bytes": 64 << 20},
                tmp_path / "ok.log",
            )
            assert healthy["state"] == "success", healthy
            assert {t: v["state"] for t, v in healthy["tasks"].items()} == {
                "slot_lag": "success",
                "stream_heartbeat": "success",
                "parked_messages": "success",
            }
            assert hook.received == []  # healthy: nobody is paged

            lagging = dag_test(
                dag_runner,
                "sequin_monitoring",
                {**checks, "slot": "lagging_slot", "max_lag_bytes": 100_000},
                tmp_path / "lag.log",
            )
            alerts = list(hook.received)
    finally:
        execute(dsn, "SELECT pg_drop_replication_slot('lagging_slot')")
    assert lagging["state"] == "failed", lagging
    assert {t: v["state"] for t, v in lagging["tasks"].items()} == {
        "slot_lag": "failed",
        "stream_heartbeat": "success",
        "parked_messages": "success",
    }
    assert [(a["path"], a["json"]["title"]) for a in alerts] == [("/alerts", "Sequin: replication slot lagging")]
    alert = alerts[0]["json"]
    assert (alert["dag_id"], alert["task_id"], alert["state"]) == ("sequin_monitoring", "slot_lag", "failed")
    assert "lagging_slot" in alert["message"] and "100000" in alert["message"], alert


def test_dag_test_supervisor_that_gives_up_fails_and_alerts(
    dag_runner: DagRunner, dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream app that cannot start: the supervisor gives up after its bounded restarts, the task
    fails and ``sequin_replication``'s failure alert is posted."""
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v text)")
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}, publication: {{name: pub_{dbname}}}}}]
        sinks: [{{name: kv_sink, tables: [kv], filter: "record.v ==== 'x'", destination: {{type: sequin_stream}}}}]
        stream: {{checkpoint_location: "{tmp_path / "ckpt"}"}}
        """,
    )  # valid YAML, invalid Spark SQL: the app exits with 2 at every start
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_DEFAULT", sequin_connection(dsn, config_path=str(config)))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    monkeypatch.setenv("SEQUIN_MAX_RESTARTS", "1")
    monkeypatch.setenv("SEQUIN_RESTART_BACKOFF", "0.2")
    monkeypatch.setenv("SEQUIN_SUPERVISOR_RETRIES", "0")
    with Webhook() as hook:
        monkeypatch.setenv("SEQUIN_ALERT_WEBHOOK_URL", f"{hook.url}/pager")
        result = dag_test(dag_runner, "sequin_replication", {}, tmp_path / "dag.log")
        alerts = list(hook.received)
    assert result["state"] == "failed" and result["tasks"]["supervise_stream"]["state"] == "failed", result
    assert [a["json"]["title"] for a in alerts] == ["Sequin stream app down"]
    alert = alerts[0]["json"]
    assert (alert["dag_id"], alert["task_id"]) == ("sequin_replication", "supervise_stream")
    assert "giving up after 1 consecutive restarts" in alert["exception"], alert
    assert "sinks[0].filter: invalid SQL" in alert["exception"], alert


def server_lock_held(dsn: str) -> bool:
    """Whether the backfill server of database ``app`` holds its lock (looked at, not taken)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return server_lock(dsn, "sequin", "app").seen_held(conn)


def test_dag_test_backfill_goes_to_the_supervised_backfill_server(
    dag_runner: DagRunner, connections: tuple[str, Path], tmp_path: Path
) -> None:
    """``sequin_backfill_server``'s operator keeps ``sequin backfill serve`` up; a backfill triggered
    through ``sequin_backfill`` then goes to it (no spark-submit of its own) and delivers every row
    exactly; ``on_kill`` stops the server and frees its locks."""
    dsn, _ = connections
    (op,) = dagbag().dags["sequin_backfill_server"].tasks
    assert isinstance(op, SequinBackfillServerOperator)
    op.driver_memory, op.poll_interval, op.start_timeout = "1g", 0.5, 300
    outcome: dict[str, Any] = {}

    def supervise() -> None:
        try:
            outcome["result"] = op.execute(context={})
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    try:
        wait_for(lambda: outcome or server_lock_held(dsn), 300, what="the supervised backfill server")
        assert not outcome, outcome
        log = tmp_path / "dag.log"
        result = dag_test(dag_runner, "sequin_backfill", {"sink": "events_sink", "table": "events"}, log)
        assert result["state"] == "success", result
        text = log.read_text()
        assert "goes to the backfill server of database 'app'" in text
        assert "Spark-Submit cmd" not in text  # the task started no Spark app
        final = backfill(dsn, int(result["tasks"]["backfill"]["xcom"]))
        assert (final.state, final.rows_processed) == ("completed", 200)
        reads = [
            m
            for m in sink_messages(dsn, "events_sink")
            if m["metadata"]["idempotency_key"].startswith(f"backfill:{final.id}:")
        ]
        assert sorted(m["record"]["id"] for m in reads) == list(range(1, 201))
        assert op.restarts == 0 and len(op.runs) == 1
    finally:
        op.on_kill()
        thread.join(180)
    assert "the supervisor was stopped" in str(outcome.get("error"))
    assert all(no_process_left(run.pid) for run in op.runs)
    assert not server_lock_held(dsn)


# -- assets --------------------------------------------------------------------------------------------


def asset_events(airflow_env: dict[str, str], run_id: str) -> list[dict[str, Any]]:
    """The asset events a run emitted (metadata database), with their asset and the DAGs they queued."""
    database = airflow_env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///")
    with sqlite3.connect(database) as db:
        rows = db.execute(
            "SELECT a.id, a.name, a.uri, e.extra, e.source_dag_id, e.source_task_id FROM asset_event e"
            " JOIN asset a ON a.id = e.asset_id WHERE e.source_run_id = ? ORDER BY e.id",
            (run_id,),
        ).fetchall()
        return [
            {
                "name": name,
                "uri": uri,
                "extra": json.loads(extra),
                "source": (dag_id, task_id),
                "queued": sorted(
                    r[0]
                    for r in db.execute("SELECT target_dag_id FROM asset_dag_run_queue WHERE asset_id = ?", (asset_id,))
                ),
            }
            for asset_id, name, uri, extra, dag_id, task_id in rows
        ]


def example_on(monkeypatch: pytest.MonkeyPatch, table: str, sink: str) -> None:
    """Schedule ``sequin_downstream_example`` on ``table`` of database ``app`` as delivered to ``sink``."""
    monkeypatch.setenv("SEQUIN_EXAMPLE_DATABASE", "app")
    monkeypatch.setenv("SEQUIN_EXAMPLE_TABLE", table)
    monkeypatch.setenv("SEQUIN_EXAMPLE_SINK", sink)


def test_dag_test_backfill_emits_its_asset_event_and_the_downstream_dag_runs_after_it(
    dag_runner: DagRunner,
    airflow_env: dict[str, str],
    connections: tuple[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A completed backfill emits one event of its sink table's asset, extra: rows, position, sink; the
    DAG scheduled on that asset is queued, and the scheduler creates its asset-triggered run with it."""
    dsn, _ = connections
    example_on(monkeypatch, "public.events", "events_sink")
    result = dag_test(
        dag_runner,
        "sequin_backfill",
        {"sink": "events_sink", "table": "events"},
        tmp_path / "dag.log",
        schedule="sequin_downstream_example",
    )
    assert result["state"] == "success", result
    final = backfill(dsn, int(result["tasks"]["backfill"]["xcom"]))
    with psycopg.connect(dsn) as conn:
        now_lsn = lsn_to_int(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])  # type: ignore[index]
    (event,) = asset_events(airflow_env, result["run_id"])
    assert (event["name"], event["uri"]) == (
        "sequin:app/public.events@events_sink",
        "sequin://app/public.events?sink=events_sink",
    )
    assert event["source"] == ("sequin_backfill", "backfill")
    assert event["queued"] == []  # the event queued the downstream DAG; the scheduler made its run of it (below)
    extra = event["extra"]
    position = extra.pop("position")
    assert extra == {
        "event": "backfill_completed",
        "database": "app",
        "sink": "events_sink",
        "table": "public.events",
        "backfill_id": final.id,
        "kind": "full",
        "rows": 200,
        "rows_emitted": 200,
        "position_lsn": int_to_lsn(position),
        "finished_at": final.finished_at.isoformat(),
    }
    reads = [
        m
        for m in sink_messages(dsn, "events_sink")
        if m["metadata"]["idempotency_key"].startswith(f"backfill:{final.id}:")
    ]
    assert sorted(m["record"]["id"] for m in reads) == list(range(1, 201))
    assert max(m["metadata"]["commit_lsn"] for m in reads) < position <= now_lsn  # every read is before it
    (run,) = result["scheduled"]
    assert run["run_type"] == "asset_triggered" and run["state"] == "queued"
    assert [e["backfill_id"] for e in run["events"]] == [final.id]


def test_the_downstream_example_reads_what_its_triggering_events_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sequin_downstream_example``'s task returns the extras of the events of its asset that triggered it."""
    example_on(monkeypatch, "public.events", "events_sink")
    dag = dagbag().dags["sequin_downstream_example"]
    (asset,) = dag.schedule
    assert asset.uri == "sequin://app/public.events?sink=events_sink"
    freshness = {"event": "freshness", "sink": "events_sink", "table": "public.events", "complete_through": "T"}
    done = {"event": "backfill_completed", "table": "public.events", "backfill_id": 7, "rows": 200}
    events = {asset: [SimpleNamespace(extra=freshness), SimpleNamespace(extra=done)]}
    assert dag.task_dict["delivered"].python_callable(triggering_asset_events=events) == [freshness, done]
    assert dag.task_dict["delivered"].python_callable(triggering_asset_events={}) == []


def test_dag_test_freshness_is_never_ahead_of_what_is_delivered(
    dag_runner: DagRunner,
    airflow_env: dict[str, str],
    connections: tuple[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While rows are written, ``sequin_freshness`` emits per sink table ``complete_through`` T: every
    change committed at or before T was in the sink (visible) when the run ended, and T is recent; the
    DAG scheduled on one of these assets gets an asset-triggered run with the event."""
    dsn, _ = connections
    example_on(monkeypatch, "public.events", "events_sink")
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            next_id = 100_000
            while not stop.is_set():
                conn.execute("INSERT INTO events VALUES (%s, timestamptz '2024-01-01 00:00:00+00')", (next_id,))
                written.append(next_id)
                next_id += 1
                time.sleep(0.01)

    thread = threading.Thread(target=writer, daemon=True)
    started = datetime.now(timezone.utc)
    thread.start()
    try:
        result = dag_test(
            dag_runner, "sequin_freshness", {}, tmp_path / "dag.log", schedule="sequin_downstream_example"
        )
        seen = {m["metadata"]["idempotency_key"] for m in sink_messages(dsn, "events_sink")}
    finally:
        stop.set()
        thread.join(30)
    assert result["state"] == "success", result
    summary = result["tasks"]["freshness"]["xcom"]
    summary = summary if isinstance(summary, dict) else json.loads(summary)
    through = summary["app"]["complete_through"]
    assert sorted(summary["app"]["sinks"]) == ["events_sink", "items_log", "items_sink"]
    assert summary["app"]["behind"] == []
    t = datetime.fromisoformat(through)
    assert started - timedelta(seconds=5) < t < datetime.now(timezone.utc)

    events = asset_events(airflow_env, result["run_id"])
    assert sorted((e["extra"]["sink"], e["extra"]["table"]) for e in events) == [
        ("events_sink", "public.events"),
        ("items_log", "public.items"),
        ("items_sink", "public.items"),
    ]
    assert {e["extra"]["complete_through"] for e in events} == {through}
    for e in events:
        assert e["extra"]["confirmed_position"] >= e["extra"]["position"] and e["source"][0] == "sequin_freshness"

    # every change committed at or before T was delivered when the run ended
    everything = wait_for(
        lambda: (lambda ms: ms if {m["record"]["id"] for m in ms} >= set(written) else None)(
            [m for m in sink_messages(dsn, "events_sink") if m["action"] == "insert" and m["record"]["id"] >= 100_000]
        ),
        120,
        what="every written row in the sink",
    )
    before = [m for m in everything if datetime.fromisoformat(m["metadata"]["commit_timestamp"]) <= t]
    assert len(before) > 10 and len(everything) > len(before)  # writes on both sides of T
    assert [m["record"]["id"] for m in before if m["metadata"]["idempotency_key"] not in seen] == []

    (run,) = [r for r in result["scheduled"] if any(e.get("event") == "freshness" for e in r["events"])]
    assert run["run_type"] == "asset_triggered"
    assert [e["complete_through"] for e in run["events"] if e.get("event") == "freshness"] == [through]
    execute(dsn, "DELETE FROM events WHERE id >= 100000")


# -- connections stored in Airflow's metadata database ------------------------------------------------

META_PASSWORD = "pw-Meta-7f3k9q"
"""The password of the metadata-database connections: it must not reach a log or a command line."""

META_CONFIG = """
databases:
  - name: app
    conn_id: pg_meta_source
    slot: {{name: {slot}}}
    publication: {{name: {publication}}}
    heartbeat_interval: 1s
store:
  conn_id: pg_meta_store
sinks:
  - {{name: items_sink, tables: [items], destination: {{type: sequin_stream}}}}
  - {{name: events_sink, tables: [events], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {ckpt}
"""

META_DAG = """
from datetime import datetime

from airflow.sdk import DAG, task
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.backfill_server import SequinBackfillServerOperator

with DAG("sequin_meta_connections", schedule=None, start_date=datetime(2025, 1, 1), catchup=False):
    @task
    def hook_check(params=None):
        hook = SequinHook("sequin_meta")
        config = hook.load_config()
        return {"lag_bytes": hook.slot_lag_bytes(params["slot"]), "parked": hook.parked_counts(),
                "heartbeat_seen": hook.heartbeat_age_seconds("app") is not None,
                "conn_ids": [config.database("app").conn_id, config.store.conn_id],
                "same_source": config.database("app").dsn == hook.settings.source_dsn,
                "same_store": config.store_dsn("app") == hook.settings.store_dsn}

    hook_check()
    if BACKFILL:
        SequinBackfillOperator(task_id="backfill", sink="items_sink", table="items", max_query_ms=2000,
                               sequin_conn_id="sequin_meta", spark_conn_id="spark_meta")
"""


def metadata_connections(dsn: str, config: Path) -> list[dict[str, Any]]:
    """``sequin_meta`` (naming the Postgres connections of the source and the store, and the config),
    ``pg_meta_source``/``pg_meta_store`` (role ``meta_user`` with a password) and ``spark_meta``."""
    parts = conninfo_to_dict(dsn)
    postgres = {
        "conn_type": "postgres",
        "host": parts.get("host"),
        "port": int(parts.get("port") or 5432),
        "login": "meta_user",
        "password": META_PASSWORD,
        "schema": parts.get("dbname"),
    }
    return [
        {"conn_id": "pg_meta_source", **postgres},
        {"conn_id": "pg_meta_store", **postgres},
        {
            "conn_id": "sequin_meta",
            "conn_type": "sequin",
            "extra": json.dumps(
                {"source_conn_id": "pg_meta_source", "store_conn_id": "pg_meta_store", "config_path": str(config)}
            ),
        },
        {"conn_id": "spark_meta", "conn_type": "spark", "host": "local[1]"},
    ]


def meta_dag(tmp_path: Path, backfill: bool) -> Path:
    """A DAG folder with ``sequin_meta_connections`` (the hook check, and the backfill if asked)."""
    folder = tmp_path / "meta_dags"
    folder.mkdir()
    (folder / "meta.py").write_text(META_DAG.replace("BACKFILL", repr(backfill)))
    return folder


def meta_user(dsn: str) -> None:
    execute(
        dsn,
        "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'meta_user') THEN"
        f" CREATE ROLE meta_user LOGIN SUPERUSER PASSWORD '{META_PASSWORD}'; END IF; END $$",
    )


def no_airflow_conn_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("AIRFLOW_CONN_"):
            monkeypatch.delenv(name)


def test_the_hook_resolves_connections_stored_in_the_metadata_database(
    dag_runner: DagRunner, dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``AIRFLOW_CONN_*`` variable anywhere: the ``sequin`` connection names the Postgres connections
    of the source and the store, and the config's ``conn_id``s are the same, all in the metadata DB."""
    no_airflow_conn_env(monkeypatch)
    meta_user(dsn)
    slot = f"slot_{dbname}"[:63]
    execute(
        dsn,
        f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')",
        "CREATE TABLE filler (id serial PRIMARY KEY, body text)",
        "INSERT INTO filler (body) SELECT repeat('x', 200) FROM generate_series(1, 2000)",
    )
    try:
        with psycopg.connect(dsn) as conn:
            store.migrate(conn, "sequin")
        config = write_config(
            tmp_path / "sequin.yaml", META_CONFIG.format(slot=slot, publication="pub_meta", ckpt=tmp_path / "ckpt")
        )
        log = tmp_path / "dag.log"
        result = dag_test(
            dag_runner,
            "sequin_meta_connections",
            {"slot": slot},
            log,
            dags=meta_dag(tmp_path, backfill=False),
            connections=metadata_connections(dsn, config),
        )
    finally:
        execute(dsn, f"SELECT pg_drop_replication_slot('{slot}')")
    assert result["state"] == "success", (result, log.read_text()[-4000:])
    checked = result["tasks"]["hook_check"]["xcom"]
    assert checked["lag_bytes"] > 400_000, checked  # the ~0.5 MB written after the slot
    assert checked["parked"] == {} and checked["heartbeat_seen"] is False
    assert checked["conn_ids"] == ["pg_meta_source", "pg_meta_store"]
    assert checked["same_source"] and checked["same_store"], checked
    assert META_PASSWORD not in log.read_text()


def test_a_backfill_with_only_metadata_database_connections_runs_through_spark_submit(
    dag_runner: DagRunner, streaming_db: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config names only ``conn_id``s stored in the metadata DB: the operator resolves them through
    Airflow and hands them to the submitted app (which has no Airflow) as ``AIRFLOW_CONN_*`` variables of
    its process; the password reaches neither the task log nor spark-submit's command line."""
    dsn, _ = streaming_db
    no_airflow_conn_env(monkeypatch)
    meta_user(dsn)
    config = write_config(
        tmp_path / "sequin.yaml",
        META_CONFIG.format(slot="slot_dagtest", publication="pub_dagtest", ckpt=tmp_path / "ckpt"),
    )
    log = tmp_path / "dag.log"
    result = dag_test(
        dag_runner,
        "sequin_meta_connections",
        {"slot": "slot_dagtest"},
        log,
        dags=meta_dag(tmp_path, backfill=True),
        connections=metadata_connections(dsn, config),
    )
    text = log.read_text()
    assert result["state"] == "success", (result, text[-6000:])
    checked = result["tasks"]["hook_check"]["xcom"]
    assert checked["heartbeat_seen"] and checked["same_source"] and checked["same_store"], checked
    final = backfill(dsn, int(result["tasks"]["backfill"]["xcom"]))
    assert (final.state, final.rows_processed) == ("completed", 3000)
    reads = [
        m
        for m in sink_messages(dsn, "items_sink")
        if m["action"] == "read" and m["metadata"]["idempotency_key"].startswith(f"backfill:{final.id}:")
    ]
    assert sorted(m["record"]["id"] for m in reads) == list(range(1, 3001))
    assert all(m["record"]["name"] == f"item {m['record']['id']}" for m in reads)
    (command,) = [line for line in text.splitlines() if "Spark-Submit cmd:" in line]
    assert "backfill.py" in command and "AIRFLOW_CONN" not in command and "meta_user" not in command
    assert "***" not in command  # not even masked: the DSNs are not on the command line
    assert META_PASSWORD not in text
