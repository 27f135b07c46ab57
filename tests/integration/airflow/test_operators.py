"""The operators against real Postgres and a real spark-submit (local mode).

Where the outcome does not depend on what the Spark app does, the app is a small stand-in script
(``FAKE_APP``) submitted through the same ``SparkSubmitHook`` path: it records its start, its
arguments and the SIGTERM it receives, and fails or sleeps on demand. The real apps run in
``tests/integration/airflow/test_replication_supervisor.py`` and in the ``dag.test()`` of
``tests/integration/airflow/test_dags.py``; what needs no server is ``tests/unit/test_operators.py``.
"""

from __future__ import annotations

import importlib
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import psutil
import psycopg
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.backfill import run_lock, server_lock
from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.backfill_server import SequinBackfillServerOperator
from sequin_provider.operators.buffer import SequinBufferRetryOperator
from sequin_provider.operators.common import task_instance_key
from sequin_provider.operators.replication import (
    SequinReplicationOperator,
    StreamLock,
)
from sequin_provider.triggers.sequin import BackfillCompletedTrigger
from tests.support.airflow import lock_is_free, no_process_left, sequin_connection
from tests.support.config import write_config
from tests.support.postgres import execute
from tests.support.receiver import Receiver

FAKE_APP = """\
import os, signal, sys, time
log = os.environ["FAKE_APP_LOG"]
def note(text):
    with open(log, "a") as f:
        f.write(text + "\\n")
def term(signum, frame):
    note(f"term {os.getpid()}")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
note(f"start {os.getpid()} {' '.join(sys.argv[1:])}")
if os.environ.get("FAKE_APP_MODE") == "fail":
    print("2026-01-01 00:00:00,000 ERROR sequin.fake: the fake app failed on purpose", flush=True)
    sys.exit(3)
while True:
    time.sleep(0.2)
"""

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - {{name: items_sink, tables: [items], destination: {{type: sequin_stream}}}}
  - name: hooks
    tables: [items]
    destination: {{type: webhook, url: "{url}", batch: false, timeout: 5s}}
stream:
  checkpoint_location: {ckpt}
"""


class Env:
    """The test's database, config file and connections."""

    def __init__(self, dsn: str, db: str, tmp: Path) -> None:
        self.dsn = dsn
        self.tmp = tmp
        self.receiver = Receiver().start()
        self.config = write_config(
            tmp / "sequin.yaml", CONFIG.format(dsn=dsn, db=db, url=self.receiver.url, ckpt=tmp / "ckpt")
        )
        self.app = tmp / "fake_app.py"
        self.app.write_text(FAKE_APP)
        self.app_log = tmp / "fake_app.log"

    def fake_env(self, mode: str = "sleep") -> dict[str, str]:
        return {"FAKE_APP_LOG": str(self.app_log), "FAKE_APP_MODE": mode}

    def app_events(self) -> list[list[str]]:
        """The fake app's notes: ``["start", pid, args...]``, ``["term", pid]``."""
        return [line.split() for line in self.app_log.read_text().splitlines()] if self.app_log.exists() else []

    def backfills(self) -> list[store.Backfill]:
        with psycopg.connect(self.dsn) as conn:
            return store.list_backfills(conn, "sequin")


@pytest.fixture
def env(dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    """Connections ``sequin_default`` (with ``config_path``) and ``spark_default`` (``local[1]``)."""
    execute(
        dsn,
        "CREATE TABLE items (id int PRIMARY KEY, updated_at timestamptz)",
        "INSERT INTO items SELECT g, timestamptz '2025-01-01 00:00:00+00' + g * interval '1 hour'"
        " FROM generate_series(1, 50) g",
    )
    e = Env(dsn, dbname, tmp_path)
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_DEFAULT", sequin_connection(dsn, config_path=str(e.config)))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    yield e
    e.receiver.stop()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a thread; its result or exception lands in the returned dict."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# -- spark-submit plumbing -------------------------------------------------------------------------

# -- SequinBackfillOperator ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sink": "nope", "table": "items"}, "unknown sink 'nope' (configured sinks: items_sink, hooks)"),
        ({"sink": "items_sink", "table": "other"}, "sink 'items_sink' does not capture public.other"),
        (
            {"sink": "items_sink", "table": "items", "sort_column": "nope", "start_position": "1"},
            "sort column 'nope' is not a column of public.items",
        ),
        (
            {"sink": "items_sink", "table": "items", "sort_column": "updated_at", "start_position": "yesterday-ish"},
            "start position 'yesterday-ish' is not a valid timestamp with time zone",
        ),
        (
            {"sink": "items_sink", "table": "items", "where": "colour = 'red'"},
            'backfill condition "colour = \'red\'" is not valid on the source: column "colour" does not exist',
        ),
    ],
)
def test_backfill_bad_input_fails_with_the_reason_and_records_nothing(
    env: Env, kwargs: dict[str, Any], message: str
) -> None:
    op = SequinBackfillOperator(task_id="b", **kwargs)
    with pytest.raises(AirflowFailException, match=re.escape(message)):
        op.execute(context={})
    assert env.backfills() == []


def test_backfill_config_and_connection_must_name_the_same_store_schema(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_SEQUIN_OTHER", sequin_connection(env.dsn, config_path=str(env.config), store_schema="cdc")
    )
    op = SequinBackfillOperator(task_id="b", sink="items_sink", table="items", sequin_conn_id="sequin_other")
    with pytest.raises(AirflowFailException, match="names store schema 'cdc' but .* has store.schema 'sequin'"):
        op.execute(context={})
    assert env.backfills() == []


class FinishedRun:
    """A spark-submit run that already returned (for ``after_run``)."""

    def __init__(self, succeeded: bool, failure: str = "spark-submit exited with 1: boom") -> None:
        self.succeeded = succeeded
        self._failure = failure
        self.killed = False

    def failure(self) -> str:
        return self._failure

    def kill(self) -> None:
        self.killed = True


def recorded(env: Env, state: str = "pending", **kwargs: Any) -> tuple[SequinBackfillOperator, store.Backfill]:
    """An operator whose backfill is recorded (as ``execute`` does) and moved to ``state``."""
    op = SequinBackfillOperator(task_id="b", sink="items_sink", table="items", **kwargs)
    from sequin_provider.config import load_config

    backfill = op.create(load_config(env.config), op.request())
    op.backfill_id = backfill.id
    with psycopg.connect(env.dsn) as conn:
        if state in ("running", "completed"):
            store.transition_backfill(conn, "sequin", backfill.id, "running")
        if state == "completed":
            store.transition_backfill(conn, "sequin", backfill.id, "completed")
        if state == "failed":
            store.transition_backfill(conn, "sequin", backfill.id, "failed", "page 3: QueryCanceled")
    return op, backfill


def test_backfill_condition_reaches_the_recorded_backfill(env: Env) -> None:
    _, backfill = recorded(env, where=" id <= 10 ")
    assert backfill.where == "id <= 10" and backfill.kind == "full"
    assert [b.where for b in env.backfills()] == ["id <= 10"]


def test_after_run_completed_returns_the_backfill_id(env: Env) -> None:
    op, backfill = recorded(env, "completed")
    assert op.after_run(FinishedRun(True)) == backfill.id  # type: ignore[arg-type]


def test_after_run_failed_backfill_fails_the_task_with_its_error(env: Env) -> None:
    op, backfill = recorded(env, "failed")
    with pytest.raises(AirflowException, match=f"backfill {backfill.id} failed: page 3: QueryCanceled"):
        op.after_run(FinishedRun(True))  # type: ignore[arg-type]


def test_after_run_app_died_marks_the_backfill_failed_so_a_retry_can_start_again(env: Env) -> None:
    op, backfill = recorded(env, "running")
    with pytest.raises(AirflowException, match="the backfill app stopped before the backfill finished .*boom"):
        op.after_run(FinishedRun(False))  # type: ignore[arg-type]
    (after,) = env.backfills()
    assert after.state == "failed" and "boom" in (after.error or "")
    again, _ = recorded(env)  # not blocked by an orphaned active backfill
    assert again.backfill_id != backfill.id


def test_after_run_detached_app_defers_to_the_completion_trigger(env: Env) -> None:
    op, backfill = recorded(env, "running", poll_interval=2.5, wait_timeout=600)
    with pytest.raises(TaskDeferred) as deferred:
        op.after_run(FinishedRun(True))  # type: ignore[arg-type]
    trigger = deferred.value.trigger
    assert isinstance(trigger, BackfillCompletedTrigger) and deferred.value.method_name == "execute_complete"
    classpath, kwargs = trigger.serialize()
    rebuilt = getattr(importlib.import_module(classpath.rpartition(".")[0]), classpath.rpartition(".")[2])(**kwargs)
    assert (rebuilt.backfill_id, rebuilt.poke_interval, rebuilt.sequin_conn_id) == (backfill.id, 2.5, "sequin_default")
    assert rebuilt.end_time is not None


def test_after_run_detached_app_not_deferrable_waits_in_the_worker(env: Env) -> None:
    op, backfill = recorded(env, "running", deferrable=False, poll_interval=0.05)
    reads: list[int] = []
    read = op.hook.backfill

    def counted(backfill_id: int) -> store.Backfill:
        reads.append(backfill_id)
        return read(backfill_id)

    op.hook.backfill = counted  # type: ignore[method-assign]
    thread, outcome = in_thread(lambda: op.after_run(FinishedRun(True)))  # type: ignore[arg-type]
    wait_for(lambda: len(reads) >= 3, 60, interval=0.01, what="the operator to poll the store")  # still running
    assert thread.is_alive()
    with psycopg.connect(env.dsn) as conn:
        store.transition_backfill(conn, "sequin", backfill.id, "completed")
    thread.join(60)
    assert outcome == {"result": backfill.id}


def test_execute_complete_success_error_and_timeout(env: Env) -> None:
    op, backfill = recorded(env, "running")
    assert op.execute_complete({}, {"status": "success", "backfill_id": backfill.id, "message": "done"}) == backfill.id
    with pytest.raises(AirflowException, match="backfill 7 failed: disk full"):
        op.execute_complete({}, {"status": "error", "backfill_id": 7, "message": "backfill 7 failed: disk full"})
    with pytest.raises(AirflowException, match="timed out"):
        op.execute_complete({}, {"status": "timeout", "backfill_id": backfill.id, "message": "timed out waiting"})
    (after,) = env.backfills()  # given up: cancelled, so the sink's table is free again
    assert after.state == "cancelled" and "the task stopped waiting" in (after.error or "")


def test_backfill_app_failure_through_spark_submit_fails_the_task_and_the_backfill(env: Env) -> None:
    op = SequinBackfillOperator(
        task_id="b", sink="items_sink", table="items", application=str(env.app), env_vars=env.fake_env("fail")
    )
    with pytest.raises(AirflowException, match="the fake app failed on purpose"):
        op.execute(context={})
    (started,) = [e for e in env.app_events() if e[0] == "start"]
    args = started[2:]
    assert args[args.index("--backfill-id") + 1] == str(op.backfill_id)
    assert args[args.index("--master") + 1] == "local[1]"  # the connection's master reaches the app
    assert args[args.index("--config") + 1] == str(env.config)
    (after,) = env.backfills()
    assert after.state == "failed" and "exited with 3" in (after.error or "")


def test_backfill_on_kill_cancels_the_backfill_and_kills_the_job(env: Env) -> None:
    op = SequinBackfillOperator(
        task_id="b", sink="items_sink", table="items", application=str(env.app), env_vars=env.fake_env()
    )
    thread, outcome = in_thread(lambda: op.execute(context={}))
    wait_for(lambda: any(e[0] == "start" for e in env.app_events()), 300, what="the app to start")
    pid = op._run.pid if op._run else None
    op.on_kill()
    thread.join(120)
    assert isinstance(outcome.get("error"), AirflowException)
    assert f"backfill {op.backfill_id} cancelled: the Airflow task was killed" in str(outcome["error"])
    (after,) = env.backfills()
    assert after.state == "cancelled"
    assert no_process_left(pid)


def earlier_try(env: Env, state: str = "running") -> tuple[dict[str, Any], store.Backfill]:
    """A task instance's context, and the backfill an earlier try of it started (then its worker was lost)."""
    from sequin_provider.config import load_config

    context = {"ti": SimpleNamespace(dag_id="nightly", task_id="b", run_id="scheduled__2026-11-21", map_index=-1)}
    first = SequinBackfillOperator(task_id="b", sink="items_sink", table="items")
    backfill = first.create(load_config(env.config), first.request(), task_instance_key(context))
    assert backfill.requested_by == "airflow:nightly/b/scheduled__2026-11-21" and not first.adopted
    if state == "running":
        with psycopg.connect(env.dsn) as conn:
            backfill = store.transition_backfill(conn, "sequin", backfill.id, "running")
    return context, backfill


def test_a_retry_resumes_the_backfill_its_earlier_try_started_and_others_are_still_refused(env: Env) -> None:
    context, earlier = earlier_try(env)
    mapped = {"ti": SimpleNamespace(dag_id="nightly", task_id="b", run_id="scheduled__2026-11-21", map_index=2)}
    for other in ({}, mapped, {"ti": SimpleNamespace(dag_id="nightly", task_id="b", run_id="manual__x", map_index=-1)}):
        op = SequinBackfillOperator(task_id="b", sink="items_sink", table="items", application=str(env.app))
        with pytest.raises(
            AirflowFailException,
            match=f"already has an active backfill of public.items: backfill"
            f" {earlier.id} \\(running, requested by airflow:nightly/b/",
        ):
            op.execute(other)
    changed = SequinBackfillOperator(
        task_id="b", sink="items_sink", table="items", max_query_ms=100, application=str(env.app)
    )
    with pytest.raises(
        AirflowFailException, match="an earlier try of this task started it with max_query_ms 5000 \\(now 100\\)"
    ):
        changed.execute(context)
    narrowed = SequinBackfillOperator(
        task_id="b", sink="items_sink", table="items", where="id > 5", application=str(env.app)
    )
    with pytest.raises(AirflowFailException, match="started it with where None \\(now 'id > 5'\\)"):
        narrowed.execute(context)
    assert env.app_events() == [] and [b.id for b in env.backfills()] == [earlier.id]
    # the retry: same task instance, same request -> the same backfill goes to the app (which fails here)
    retry = SequinBackfillOperator(
        task_id="b", sink="items_sink", table="items", application=str(env.app), env_vars=env.fake_env("fail")
    )
    with pytest.raises(AirflowException, match="the fake app failed on purpose"):
        retry.execute(context)
    assert retry.adopted and retry.backfill_id == earlier.id
    (started,) = [e for e in env.app_events() if e[0] == "start"]
    assert started[started.index("--backfill-id") + 1] == str(earlier.id)
    (after,) = env.backfills()
    assert after.id == earlier.id and after.state == "failed"


def test_a_retry_waits_for_the_app_still_running_its_backfill_instead_of_starting_another(env: Env) -> None:
    context, earlier = earlier_try(env)
    app = run_lock(env.dsn, "sequin", earlier.id, "the earlier try's app")  # e.g. a driver in cluster mode
    assert app.acquire()
    try:
        retry = SequinBackfillOperator(
            task_id="b",
            sink="items_sink",
            table="items",
            application=str(env.app),
            env_vars=env.fake_env(),
            takeover_wait=0.5,
            poll_interval=1.0,
        )
        with pytest.raises(TaskDeferred) as deferred:
            retry.execute(context)
    finally:
        app.release()
    trigger = deferred.value.trigger
    assert isinstance(trigger, BackfillCompletedTrigger) and trigger.backfill_id == earlier.id
    assert env.app_events() == []  # no second app for the same backfill
    (after,) = env.backfills()
    assert after.state == "running"


def test_with_a_backfill_server_up_the_operator_submits_nothing_and_waits_for_the_backfill(env: Env) -> None:
    """The server is stood in for by its lock (held here) and by this test completing the backfill in
    the store as the server would: the server itself is tested in test_backfill_server.py."""
    server = server_lock(env.dsn, "sequin", "app", "a backfill server")
    assert server.acquire()
    try:
        op = SequinBackfillOperator(
            task_id="b",
            sink="items_sink",
            table="items",
            application=str(env.app),
            env_vars=env.fake_env(),
            deferrable=False,
            poll_interval=0.2,
        )
        thread, outcome = in_thread(lambda: op.execute({}))
        (recorded,) = wait_for(env.backfills, 60, what="the backfill to be recorded")
        with psycopg.connect(env.dsn) as conn:
            store.transition_backfill(conn, "sequin", recorded.id, "running")
            store.transition_backfill(conn, "sequin", recorded.id, "completed")
        thread.join(timeout=60)
    finally:
        server.release()
    assert outcome.get("result") == recorded.id, outcome
    assert env.app_events() == []  # no Spark app submitted
    deferred = SequinBackfillOperator(task_id="b", sink="items_sink", table="items", application=str(env.app))
    assert server.acquire_within(10)  # the released session's backend may still be exiting, its lock with it
    try:
        with pytest.raises(TaskDeferred) as waiting:
            deferred.execute({})
    finally:
        server.release()
    assert isinstance(waiting.value.trigger, BackfillCompletedTrigger)
    assert env.app_events() == []


# -- SequinBufferRetryOperator ---------------------------------------------------------------------


def park(dsn: str, sink: str, n: int) -> None:
    rows = [store.ParkRow(sink, 100 + i, 0, "g1", f"k{i}", json.dumps({"n": i}), None, 1, "HTTP 500") for i in range(n)]
    with psycopg.connect(dsn) as conn:
        store.park_messages(conn, "sequin", rows)


def test_buffer_retry_delivers_parked_messages_in_order_and_reports(env: Env) -> None:
    park(env.dsn, "hooks", 3)
    result = SequinBufferRetryOperator(task_id="r", sink="hooks").execute(context={})
    assert result == {"delivered": 3, "still_parked": 0, "discarded": 0}
    assert [m["n"] for m in env.receiver.messages()] == [0, 1, 2]
    assert SequinBufferRetryOperator(task_id="r").execute(context={}) == {
        "delivered": 0,
        "still_parked": 0,
        "discarded": 0,
    }


def test_buffer_retry_sink_down_keeps_messages_parked(env: Env) -> None:
    park(env.dsn, "hooks", 2)
    env.receiver.policy = lambda messages: (500, 0.0)
    assert SequinBufferRetryOperator(task_id="r").execute(context={}) == {
        "delivered": 0,
        "still_parked": 2,
        "discarded": 0,
    }
    with psycopg.connect(env.dsn) as conn:  # due again now, and this time the task must fail
        conn.execute("UPDATE sequin.buffered_messages SET next_attempt_at = now()")
    with pytest.raises(AirflowException, match="2 messages are still parked"):
        SequinBufferRetryOperator(task_id="r", fail_on_parked=True).execute(context={})
    assert env.receiver.messages() == []


def test_buffer_retry_unknown_sink_is_a_clear_error(env: Env) -> None:
    with pytest.raises(AirflowFailException, match="no sink named 'nope'"):
        SequinBufferRetryOperator(task_id="r", sink="nope").execute(context={})


# -- SequinReplicationOperator: the parts that need no stream app ----------------------------------


def test_replication_refuses_to_start_when_the_lock_is_held(env: Env) -> None:
    squatter = StreamLock(env.dsn, "sequin", "app", "someone else's supervisor")
    assert squatter.acquire()
    try:
        op = SequinReplicationOperator(task_id="s", application=str(env.app), env_vars=env.fake_env())
        with pytest.raises(AirflowFailException, match="already supervised.*someone else's supervisor"):
            op.execute(context={})
        assert op.runs == [] and env.app_events() == []
    finally:
        squatter.release()


def test_replication_on_kill_stops_the_app_cleanly_and_a_second_supervisor_fails_fast(env: Env) -> None:
    op = SequinReplicationOperator(
        task_id="s", application=str(env.app), env_vars=env.fake_env(), start_timeout=3600, poll_interval=0.2
    )
    thread, outcome = in_thread(lambda: op.execute(context={}))
    wait_for(lambda: any(e[0] == "start" for e in env.app_events()), 300, what="the app to start")
    (start,) = env.app_events()
    assert start[2:] == ["--config", str(env.config), "--database", "app", "--master", "local[1]"]
    second = SequinReplicationOperator(task_id="s2", application=str(env.app), env_vars=env.fake_env())
    with pytest.raises(AirflowFailException, match="database 'app' is already supervised.*sequin-supervisor"):
        second.execute(context={})
    pid = op.current_run.pid if op.current_run else None
    op.on_kill()
    thread.join(120)
    assert "the supervisor was stopped" in str(outcome.get("error"))
    assert ["term", start[1]] in env.app_events()  # the Python driver got SIGTERM: a clean stop
    assert no_process_left(pid) and not psutil.pid_exists(int(start[1]))
    assert lock_is_free(env.dsn)


def test_replication_restarts_a_stalled_app_then_fails_after_max_restarts(env: Env) -> None:
    # the stand-in never records a heartbeat: every run stalls at start_timeout
    op = SequinReplicationOperator(
        task_id="s",
        application=str(env.app),
        env_vars=env.fake_env(),
        start_timeout=1,
        stall_timeout=5,
        max_restarts=2,
        restart_backoff=0.1,
        poll_interval=0.1,
        stop_grace_period=10,
    )
    with pytest.raises(AirflowException, match=r"stalled \(no first heartbeat for .*giving up after 2 consecutive"):
        op.execute(context={})
    assert len(op.runs) == 3 and op.restarts == 2
    assert all(run.finished and no_process_left(run.pid) for run in op.runs)
    assert lock_is_free(env.dsn)


def test_replication_run_for_stops_and_succeeds(env: Env) -> None:
    op = SequinReplicationOperator(
        task_id="s",
        application=str(env.app),
        env_vars=env.fake_env(),
        run_for=0.5,
        start_timeout=3600,
        poll_interval=0.1,
    )
    result = op.execute(context={})
    assert result["database"] == "app" and result["restarts"] == 0
    (run,) = op.runs
    assert run.finished and no_process_left(run.pid)
    assert lock_is_free(env.dsn)


# -- SequinBackfillServerOperator: the same supervision, the server's own sign of life ---------------


def server_operator(env: Env, mode: str = "sleep", **kwargs: Any) -> SequinBackfillServerOperator:
    return SequinBackfillServerOperator(
        task_id="serve",
        application=str(env.app),
        env_vars=env.fake_env(mode),
        restart_backoff=0.1,
        poll_interval=0.1,
        stop_grace_period=10,
        **kwargs,
    )


def test_backfill_server_exit_3_is_not_restarted(env: Env) -> None:
    """Exit code 3 (another server serves the database): restarting cannot help, the task fails at once."""
    op = server_operator(env, "fail", max_restarts=3, start_timeout=3600)
    with pytest.raises(AirflowException, match="another backfill server serves the database; not restarting it"):
        op.execute(context={})
    (start,) = env.app_events()
    assert start[2:] == ["--config", str(env.config), "--serve", "--database", "app", "--master", "local[1]"]
    assert len(op.runs) == 1 and op.restarts == 0


def test_backfill_server_is_alive_while_its_lock_is_held_and_restarted_when_not(env: Env) -> None:
    """The server records no heartbeat: its lock in the store held is its sign of life. A server that
    never takes it stalls and is restarted (bounded); while it is held, the server runs on."""
    op = server_operator(env, start_timeout=1, stall_timeout=5, max_restarts=1)
    with pytest.raises(AirflowException, match=r"stalled \(no first heartbeat for .*giving up after 1 consecutive"):
        op.execute(context={})
    assert len(op.runs) == 2 and all(run.finished and no_process_left(run.pid) for run in op.runs)

    server = server_lock(env.dsn, "sequin", "app", "the server (stand-in)")
    assert server.acquire()  # what the real server holds while it is up
    try:
        op = server_operator(env, start_timeout=1, stall_timeout=1, max_restarts=1, run_for=3)
        assert op.execute(context={})["restarts"] == 0
    finally:
        server.release()


def test_backfill_server_refuses_a_second_supervisor(env: Env) -> None:
    op = server_operator(env, start_timeout=3600)
    thread, outcome = in_thread(lambda: op.execute(context={}))
    wait_for(lambda: any(e[0] == "start" for e in env.app_events()), 300, what="the server to start")
    with pytest.raises(AirflowFailException, match="backfill server of database 'app' is already supervised"):
        server_operator(env).execute(context={})
    op.on_kill()
    thread.join(120)
    assert "the supervisor was stopped" in str(outcome.get("error"))
