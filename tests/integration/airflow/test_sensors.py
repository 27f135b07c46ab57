"""The sensors: defer to the right trigger, resume from its event, and poke without deferring."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout, AirflowSkipException, TaskDeferred
from psycopg.conninfo import conninfo_to_dict

from sequin_provider import store
from sequin_provider.sensors.sequin import (
    BackfillCompletedSensor,
    ParkedMessagesSensor,
    ReplicationSlotLagSensor,
    StreamHeartbeatSensor,
)
from sequin_provider.triggers.sequin import (
    BackfillCompletedTrigger,
    HeartbeatTrigger,
    ParkedMessagesTrigger,
    SequinPollingTrigger,
)

CONN = {"sequin_conn_id": "sequin_sens"}


@pytest.fixture
def conn_env(dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Connection ``sequin_sens`` = the test database, with the store migrated into it."""
    parts = conninfo_to_dict(dsn)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SEQUIN_SENS",
        json.dumps(
            {
                "conn_type": "sequin",
                "host": parts.get("host"),
                "port": int(parts.get("port") or 5432),
                "login": parts.get("user"),
                "password": parts.get("password"),
                "schema": parts.get("dbname"),
            }
        ),
    )
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    return dsn


def park(dsn: str, sink: str, n: int) -> None:
    rows = [store.ParkRow(sink, 100 + i, 0, f"g{i}", f"k{i}", "{}", None, 1, "HTTP 500") for i in range(n)]
    with psycopg.connect(dsn) as conn:
        store.park_messages(conn, "sequin", rows)


def run_deferred(deferred: TaskDeferred) -> dict[str, Any]:
    """What the triggerer does: rebuild the trigger from its serialised form and run it to its first event."""
    classpath, kwargs = deferred.trigger.serialize()
    module, _, name = classpath.rpartition(".")
    trigger: SequinPollingTrigger = getattr(importlib.import_module(module), name)(**kwargs)

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    return asyncio.run(asyncio.wait_for(first(), 30))


def test_defers_when_not_done_and_resumes_with_the_event(conn_env: str) -> None:
    sensor = ParkedMessagesSensor(task_id="parked", sink="orders", threshold=1, poke_interval=0.05, timeout=20, **CONN)
    started = time.time()
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context={})
    trigger = deferred.value.trigger
    assert isinstance(trigger, ParkedMessagesTrigger)
    assert (trigger.sink, trigger.threshold, trigger.sequin_conn_id, trigger.poke_interval) == (
        "orders",
        1,
        "sequin_sens",
        0.05,
    )
    assert started + 20 <= trigger.end_time <= time.time() + 20
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.timeout == timedelta(seconds=20)

    park(conn_env, "orders", 2)
    event = run_deferred(deferred.value)
    result = sensor.resume_execution(deferred.value.method_name, {"event": event}, context={})
    assert result["status"] == "success" and result["parked"] == 2


def test_returns_at_once_when_already_done(conn_env: str) -> None:
    park(conn_env, "orders", 3)
    sensor = ParkedMessagesSensor(task_id="parked", threshold=2, poke_interval=0.05, timeout=20, **CONN)
    result = sensor.execute(context={})  # no TaskDeferred
    assert result["status"] == "success" and result["parked_by_sink"] == {"orders": 3}


def test_timeout_and_error_events_fail_the_task(conn_env: str) -> None:
    sensor = StreamHeartbeatSensor(
        task_id="hb", database="shop", max_age_seconds=60, fire_when="within", poke_interval=0.05, timeout=0.3, **CONN
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context={})
    assert isinstance(deferred.value.trigger, HeartbeatTrigger)
    event = run_deferred(deferred.value)
    assert event["status"] == "timeout"
    with pytest.raises(AirflowSensorTimeout, match="no heartbeat recorded"):
        sensor.resume_execution("execute_complete", {"event": event}, context={})
    with pytest.raises(AirflowException, match="boom"):
        sensor.execute_complete({}, {"status": "error", "message": "boom"})

    soft = StreamHeartbeatSensor(task_id="hb2", database="shop", max_age_seconds=60, soft_fail=True, **CONN)
    with pytest.raises(AirflowSkipException):
        soft.resume_execution("execute_complete", {"event": event}, context={})


def test_backfill_sensor_defers_then_fails_with_the_backfill_error(conn_env: str) -> None:
    with psycopg.connect(conn_env) as conn:
        backfill = store.create_backfill(conn, "sequin", "orders", "public", "orders")
    sensor = BackfillCompletedSensor(
        task_id="wait", backfill_id="{{ params.backfill_id }}", poke_interval=0.05, timeout=20, **CONN
    )
    sensor.render_template_fields({"params": {"backfill_id": backfill.id}})
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context={})
    assert isinstance(deferred.value.trigger, BackfillCompletedTrigger)
    assert deferred.value.trigger.backfill_id == backfill.id

    with psycopg.connect(conn_env) as conn:
        store.transition_backfill(conn, "sequin", backfill.id, "failed", error="permission denied for table orders")
    event = run_deferred(deferred.value)
    with pytest.raises(AirflowException, match="permission denied for table orders"):
        sensor.resume_execution(deferred.value.method_name, {"event": event}, context={})
    # Poking sees the same failure.
    with pytest.raises(AirflowException, match=f"backfill {backfill.id} failed"):
        sensor.poke({})


def test_poke_mode_waits_without_deferring(conn_env: str) -> None:
    with psycopg.connect(conn_env) as conn:
        store.update_status(conn, "sequin", "shop", heartbeat_at=datetime.now(timezone.utc) - timedelta(seconds=300))
    stale = StreamHeartbeatSensor(
        task_id="stale", database="shop", max_age_seconds=60, deferrable=False, poke_interval=0.05, timeout=5, **CONN
    )
    result = stale.execute(context={})
    assert result["status"] == "success" and result["age_seconds"] >= 300

    fresh = StreamHeartbeatSensor(
        task_id="fresh",
        database="shop",
        max_age_seconds=60,
        fire_when="within",
        deferrable=False,
        poke_interval=0.05,
        timeout=0.3,
        **CONN,
    )
    with pytest.raises(AirflowSensorTimeout):
        fresh.execute(context={})


def test_slot_lag_sensor_fails_on_a_missing_slot(conn_env: str) -> None:
    sensor = ReplicationSlotLagSensor(
        task_id="lag",
        slot="absent_slot",
        threshold_bytes="1024",
        deferrable=False,
        poke_interval=0.05,
        timeout=5,
        **CONN,
    )
    assert sensor.build_trigger(None).threshold_bytes == 1024  # templated values arrive as strings
    with pytest.raises(AirflowException, match="replication slot 'absent_slot' does not exist"):
        sensor.execute(context={})
