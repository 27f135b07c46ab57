"""SequinHook against real Postgres: slot lag, heartbeat, buffer, backfills (connection settings alone:
tests/unit/test_hooks.py)."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from typing import Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from sequin_provider import replication, store
from sequin_provider.hooks.sequin import SequinHook
from tests.support.airflow import sequin_connection
from tests.support.postgres import write_wal


def park(dsn: str, sink: str, n: int, schema: str = "sequin", start: int = 0) -> None:
    """Park ``n`` messages of ``sink`` in the buffer."""
    rows = [
        store.ParkRow(sink, 100 + i, 0, f"g{i}", f"k{i}", "{}", None, 1, "HTTP 500") for i in range(start, start + n)
    ]
    with psycopg.connect(dsn) as conn:
        store.park_messages(conn, schema, rows)


@pytest.fixture
def slot(dsn: str, dbname: str) -> Iterator[str]:
    """A logical replication slot on the test database (dropped afterwards)."""
    name = f"slot_{dbname}"[:63]
    with psycopg.connect(dsn, autocommit=True) as conn:
        replication.create_slot(conn, name)
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (name,)
        )


@pytest.fixture
def hook(dsn: str, monkeypatch: pytest.MonkeyPatch) -> SequinHook:
    """A hook on connection ``sequin_test`` = the test database (store in the same database)."""
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_TEST", sequin_connection(dsn))
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    return SequinHook("sequin_test")


def test_slot_lag_grows_with_unconsumed_wal(hook: SequinHook, dsn: str, slot: str) -> None:
    before = hook.slot_lag_bytes(slot)
    assert before is not None and before >= 0
    write_wal(dsn)
    after = hook.slot_lag_bytes(slot)
    assert after is not None and after > before + 200_000  # 2000 rows x 200 bytes went into the WAL
    info = hook.slot(slot)
    assert info is not None and info.plugin == "pgoutput" and not info.active
    assert asyncio.run(hook.aslot_lag_bytes(slot)) >= after  # type: ignore[operator]
    assert hook.slot_lag_bytes("no_such_slot") is None


def test_heartbeat_age_reads_a_separate_store(
    pg: EmbeddedPostgres, dsn: str, dbname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store_dsn = pg.create_database(f"{dbname}_st"[:63])
    with psycopg.connect(store_dsn) as conn:
        store.migrate(conn, "ops")
    monkeypatch.setenv("AIRFLOW_CONN_SEQ_STORE", sequin_connection(dsn, store_dsn=store_dsn, store_schema="ops"))
    hook = SequinHook("seq_store")
    assert hook.heartbeat_age_seconds("shop") is None  # no status row yet

    with psycopg.connect(store_dsn) as conn:
        store.update_status(conn, "ops", "shop", heartbeat_at=datetime.now(timezone.utc) - timedelta(seconds=90))
    age = hook.heartbeat_age_seconds("shop")
    assert age is not None and 90 <= age < 120
    assert hook.heartbeat_age_seconds("other") is None
    async_age = asyncio.run(hook.aheartbeat_age_seconds("shop"))
    assert async_age is not None and age <= async_age < 120
    # The source database has no store schema: the hook really read the store database.
    with psycopg.connect(dsn) as conn:
        assert store.schema_version(conn, "ops") == 0


def test_parked_counts_per_sink(hook: SequinHook, dsn: str) -> None:
    assert hook.parked_counts() == {}
    park(dsn, "orders", 3)
    park(dsn, "users", 1)
    with psycopg.connect(dsn) as conn:
        store.set_buffered_state(conn, "sequin", "users", "discarded")
        conn.commit()
    assert hook.parked_counts() == {"orders": {"parked": 3, "discarded": 0}, "users": {"parked": 0, "discarded": 1}}
    assert hook.parked_counts("orders") == {"orders": {"parked": 3, "discarded": 0}}
    assert hook.parked_counts("absent") == {"absent": {"parked": 0, "discarded": 0}}
    assert asyncio.run(hook.aparked_counts("orders")) == {"orders": {"parked": 3, "discarded": 0}}


def test_backfill_and_progress(hook: SequinHook, dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        created = store.create_backfill(conn, "sequin", "orders", "public", "orders", rows_initial=10)
        store.transition_backfill(conn, "sequin", created.id, "running")
        store.record_backfill_progress(conn, "sequin", created.id, ["5"], 5, 5)
    got = hook.backfill(created.id)
    assert (got.id, got.state, got.rows_processed) == (created.id, "running", 5)
    assert hook.backfill_progress(created.id).startswith("running, 5/10 rows (50.0%)")
    assert asyncio.run(hook.abackfill(created.id)).state == "running"
    with pytest.raises(store.BackfillError, match="no backfill with id 999"):
        hook.backfill(999)


def test_test_connection(hook: SequinHook, monkeypatch: pytest.MonkeyPatch) -> None:
    ok, message = hook.test_connection()
    assert ok, message
    assert f"store schema version {store.SCHEMA_VERSION}" in message
    monkeypatch.setenv(
        "AIRFLOW_CONN_SEQ_DOWN",
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
    ok, message = SequinHook("seq_down").test_connection()
    assert not ok and "127.0.0.1" in message
