"""SequinHook against real Postgres: connection resolution, slot lag, heartbeat, buffer, backfills."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

import psycopg
import pytest
from airflow.sdk.exceptions import AirflowNotFoundException
from psycopg.conninfo import conninfo_to_dict

from devtools.embedded_postgres import EmbeddedPostgres
from sequin_provider import buffer, replication, store
from sequin_provider.hooks.sequin import SequinConnectionSettings, SequinHook


def connection_json(dsn: str, **extra: Any) -> str:
    """An ``AIRFLOW_CONN_<ID>`` value (JSON form) for a ``sequin`` connection to ``dsn``."""
    parts = conninfo_to_dict(dsn)
    return json.dumps({"conn_type": "sequin", "host": parts.get("host"), "port": int(parts.get("port") or 5432),
                       "login": parts.get("user"), "password": parts.get("password"), "schema": parts.get("dbname"),
                       "extra": extra})


def park(dsn: str, sink: str, n: int, schema: str = "sequin", start: int = 0) -> None:
    """Park ``n`` messages of ``sink`` in the buffer."""
    rows = [buffer.ParkRow(sink, 100 + i, 0, f"g{i}", f"k{i}", "{}", None, 1, "HTTP 500") for i in range(start, start + n)]
    with psycopg.connect(dsn) as conn:
        buffer.park(conn, schema, rows)


@pytest.fixture
def slot(dsn: str, dbname: str) -> Iterator[str]:
    """A logical replication slot on the test database (dropped afterwards)."""
    name = f"slot_{dbname}"[:63]
    with psycopg.connect(dsn, autocommit=True) as conn:
        replication.create_slot(conn, name)
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                     (name,))


def write_wal(dsn: str, rows: int = 2000) -> None:
    """Commit some writes so the server's WAL position moves past the slot's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS filler (id serial PRIMARY KEY, body text)")
        conn.execute("INSERT INTO filler (body) SELECT repeat('x', 200) FROM generate_series(1, %s)", (rows,))


@pytest.fixture
def hook(dsn: str, monkeypatch: pytest.MonkeyPatch) -> SequinHook:
    """A hook on connection ``sequin_test`` = the test database (store in the same database)."""
    monkeypatch.setenv("AIRFLOW_CONN_SEQUIN_TEST", connection_json(dsn))
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    return SequinHook("sequin_test")


def test_hook_does_no_io_until_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # Built at DAG parse time inside operators: a missing connection must only fail on first use.
    monkeypatch.delenv("AIRFLOW_CONN_NOT_THERE", raising=False)
    hook = SequinHook("not_there")
    assert hook.sequin_conn_id == "not_there" and hook._settings is None
    with pytest.raises(AirflowNotFoundException):
        _ = hook.settings


def test_settings_from_json_and_uri_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SEQ_JSON", json.dumps({
        "conn_type": "sequin", "host": "db.example", "port": 6543, "login": "rep", "password": "s3cret pw",
        "schema": "shop", "extra": {"store_dsn": "postgresql://st@store.example/ops", "store_schema": "cdc",
                                    "config_path": "/etc/sequin.yaml", "sslmode": "require"}}))
    settings = SequinHook("seq_json").settings
    assert conninfo_to_dict(settings.source_dsn) == {"host": "db.example", "port": "6543", "user": "rep",
                                                     "password": "s3cret pw", "dbname": "shop",
                                                     "connect_timeout": "10", "sslmode": "require"}
    assert (settings.store_dsn, settings.store_schema, settings.config_path) == (
        "postgresql://st@store.example/ops", "cdc", "/etc/sequin.yaml")
    assert "s3cret" not in repr(settings)

    # URI form, no extras: the store is the source database, schema "sequin".
    monkeypatch.setenv("AIRFLOW_CONN_SEQ_URI", "sequin://rep:pw@db.example:5433/shop")
    uri = SequinHook("seq_uri").settings
    assert uri.store_dsn == uri.source_dsn and uri.store_schema == "sequin" and uri.config_path is None
    assert conninfo_to_dict(uri.source_dsn)["port"] == "5433"


def test_settings_accept_prefixed_extras() -> None:
    from airflow.sdk import Connection

    conn = Connection(conn_id="x", conn_type="sequin", host="h", schema="d",
                      extra=json.dumps({"extra__sequin__store_schema": "old_ui", "store_dsn": ""}))
    settings = SequinConnectionSettings.from_connection(conn)
    assert settings.store_schema == "old_ui"
    assert settings.store_dsn == settings.source_dsn  # an empty extra means "not set"


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


def test_heartbeat_age_reads_a_separate_store(pg: EmbeddedPostgres, dsn: str, dbname: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    store_dsn = pg.create_database(f"{dbname}_st"[:63])
    with psycopg.connect(store_dsn) as conn:
        store.migrate(conn, "ops")
    monkeypatch.setenv("AIRFLOW_CONN_SEQ_STORE", connection_json(dsn, store_dsn=store_dsn, store_schema="ops"))
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
        buffer.set_state(conn, "sequin", "users", "discarded")
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
    monkeypatch.setenv("AIRFLOW_CONN_SEQ_DOWN", json.dumps({"conn_type": "sequin", "host": "127.0.0.1", "port": 1,
                                                             "login": "x", "schema": "x",
                                                             "extra": {"connect_timeout": 2}}))
    ok, message = SequinHook("seq_down").test_connection()
    assert not ok and "127.0.0.1" in message
