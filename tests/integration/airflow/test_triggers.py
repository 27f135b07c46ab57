"""The deferrable triggers: success / timeout / error events on real Postgres (serialisation:
tests/unit/test_triggers.py)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from sequin_provider import replication, store
from sequin_provider.triggers.sequin import (
    BackfillCompletedTrigger,
    HeartbeatTrigger,
    ParkedMessagesTrigger,
    SequinPollingTrigger,
    SlotLagTrigger,
)
from tests.support.airflow import FAST_TRIGGER as FAST
from tests.support.postgres import write_wal


@pytest.fixture
def conn_env(dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Connection ``sequin_trig`` = the test database, with the store migrated into it."""
    parts = conninfo_to_dict(dsn)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SEQUIN_TRIG",
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


@pytest.fixture
def slot(dsn: str, dbname: str) -> Iterator[str]:
    """A logical replication slot on the test database (dropped afterwards)."""
    name = f"slot_{dbname}"[:63]
    with psycopg.connect(dsn, autocommit=True) as conn:
        replication.create_slot(conn, name)
    write_wal(dsn, 1000)
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (name,)
        )


def first_event(trigger: SequinPollingTrigger, limit: float = 30.0) -> dict[str, Any]:
    """Run the trigger as the triggerer would and return its first event's payload."""

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), limit))


def soon(seconds: float = 0.4) -> float:
    return time.time() + seconds


def park(dsn: str, sink: str, n: int) -> None:
    rows = [store.ParkRow(sink, 100 + i, 0, f"g{i}", f"k{i}", "{}", None, 1, "HTTP 500") for i in range(n)]
    with psycopg.connect(dsn) as conn:
        store.park_messages(conn, "sequin", rows)


def test_slot_lag_success_timeout_and_missing_slot(conn_env: str, slot: str) -> None:
    event = first_event(SlotLagTrigger(slot=slot, threshold_bytes=100_000, end_time=soon(), **FAST))
    assert event["status"] == "success" and event["slot"] == slot
    assert event["lag_bytes"] > 100_000  # 1000 rows x 200 bytes are not consumed

    event = first_event(SlotLagTrigger(slot=slot, threshold_bytes=10**12, end_time=soon(), **FAST))
    assert event["status"] == "timeout" and 100_000 < event["lag_bytes"] < 10**12
    assert "timed out" in event["message"]

    # The other direction: "caught up" holds at once for a huge threshold.
    event = first_event(SlotLagTrigger(slot=slot, threshold_bytes=10**12, fire_when="within", end_time=soon(), **FAST))
    assert event["status"] == "success" and event["fire_when"] == "within"

    event = first_event(SlotLagTrigger(slot="gone", threshold_bytes=0, end_time=soon(), **FAST))
    assert event == {
        "slot": "gone",
        "status": "error",
        "message": "replication slot 'gone' does not exist (or has no confirmed position)",
    }


def test_heartbeat_stale_fresh_and_missing(conn_env: str) -> None:
    stale = HeartbeatTrigger(database="shop", max_age_seconds=60, end_time=soon(), **FAST)
    event = first_event(stale)
    assert event["status"] == "success" and event["age_seconds"] is None  # never reported counts as stale
    with psycopg.connect(conn_env) as conn:
        store.update_status(conn, "sequin", "shop", heartbeat_at=datetime.now(timezone.utc) - timedelta(seconds=120))
    event = first_event(stale)
    assert event["status"] == "success" and 120 <= event["age_seconds"] < 150

    fresh = HeartbeatTrigger(database="shop", max_age_seconds=60, fire_when="within", end_time=soon(), **FAST)
    assert first_event(fresh)["status"] == "timeout"
    with psycopg.connect(conn_env) as conn:
        store.update_status(conn, "sequin", "shop", heartbeat_at=datetime.now(timezone.utc))
    event = first_event(fresh)
    assert event["status"] == "success" and event["age_seconds"] < 60


def test_parked_messages_fire_once_the_count_crosses_the_threshold(conn_env: str) -> None:
    trigger = ParkedMessagesTrigger(sink="orders", threshold=2, end_time=soon(20), **FAST)

    async def park_later_then_wait() -> dict[str, Any]:
        waiting = asyncio.create_task(anext(trigger.run()))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # 0 parked: still polling
        await asyncio.to_thread(park, conn_env, "orders", 3)
        return (await asyncio.wait_for(waiting, 10)).payload

    event = asyncio.run(park_later_then_wait())
    assert event["status"] == "success"
    assert (event["parked"], event["parked_by_sink"], event["threshold"]) == (3, {"orders": 3}, 2)

    # All sinks together; another sink's messages do not count for "orders".
    park(conn_env, "users", 1)
    assert first_event(ParkedMessagesTrigger(threshold=3, end_time=soon(), **FAST))["parked"] == 4
    event = first_event(ParkedMessagesTrigger(sink="users", threshold=1, end_time=soon(), **FAST))
    assert event["status"] == "timeout" and event["parked"] == 1


def test_backfill_completed_failed_cancelled_missing(conn_env: str) -> None:
    with psycopg.connect(conn_env) as conn:
        done = store.create_backfill(conn, "sequin", "s1", "public", "t1", rows_initial=4)
        store.transition_backfill(conn, "sequin", done.id, "running")
        store.record_backfill_progress(conn, "sequin", done.id, ["4"], 4, 4)
        running = store.create_backfill(conn, "sequin", "s2", "public", "t2")
        store.transition_backfill(conn, "sequin", running.id, "running")
        failed = store.create_backfill(conn, "sequin", "s3", "public", "t3")
        store.transition_backfill(conn, "sequin", failed.id, "failed", error="table dropped")
        cancelled = store.create_backfill(conn, "sequin", "s4", "public", "t4")

    trigger = BackfillCompletedTrigger(backfill_id=done.id, end_time=soon(20), **FAST)

    async def complete_later_then_wait() -> dict[str, Any]:
        waiting = asyncio.create_task(anext(trigger.run()))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # still running

        def complete() -> None:
            with psycopg.connect(conn_env) as conn:
                store.transition_backfill(conn, "sequin", done.id, "completed")

        await asyncio.to_thread(complete)
        return (await asyncio.wait_for(waiting, 10)).payload

    event = asyncio.run(complete_later_then_wait())
    assert (event["status"], event["backfill_id"], event["state"], event["rows_processed"]) == (
        "success",
        done.id,
        "completed",
        4,
    )
    assert event["progress"].startswith("completed, 4/4 rows (100.0%)")

    event = first_event(BackfillCompletedTrigger(backfill_id=running.id, end_time=soon(), **FAST))
    assert event["status"] == "timeout" and event["state"] == "running"

    event = first_event(BackfillCompletedTrigger(backfill_id=failed.id, end_time=soon(), **FAST))
    assert (event["status"], event["state"], event["error"]) == ("error", "failed", "table dropped")
    assert event["message"] == f"backfill {failed.id} failed: table dropped"

    with psycopg.connect(conn_env) as conn:
        store.transition_backfill(conn, "sequin", cancelled.id, "cancelled")
    event = first_event(BackfillCompletedTrigger(backfill_id=cancelled.id, end_time=soon(), **FAST))
    assert (event["status"], event["state"]) == ("error", "cancelled")

    event = first_event(BackfillCompletedTrigger(backfill_id=10_000, end_time=soon(), **FAST))
    assert event["status"] == "error" and "no backfill with id 10000" in event["message"]


def test_failures_become_error_events(conn_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A missing connection and an unreachable server: error events, never exceptions.
    monkeypatch.delenv("AIRFLOW_CONN_NOPE", raising=False)
    event = first_event(HeartbeatTrigger(database="shop", max_age_seconds=1, sequin_conn_id="nope", poke_interval=0.05))
    assert event["status"] == "error" and "nope" in event["message"]

    monkeypatch.setenv(
        "AIRFLOW_CONN_DOWN",
        json.dumps(
            {
                "conn_type": "sequin",
                "host": "127.0.0.1",
                "port": 1,
                "login": "x",
                "schema": "x",
                "extra": {"connect_timeout": 2},
            }
        ),
    )
    event = first_event(ParkedMessagesTrigger(sequin_conn_id="down", poke_interval=0.05, end_time=soon()))
    assert event["status"] == "error" and "OperationalError" in event["message"]
