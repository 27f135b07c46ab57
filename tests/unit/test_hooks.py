"""SequinHook without a server: no I/O until used, connection settings from JSON, URI and prefixed extras."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowNotFoundException
from psycopg.conninfo import conninfo_to_dict

from sequin_provider.hooks.sequin import SequinConnectionSettings, SequinHook


def test_hook_does_no_io_until_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # Built at DAG parse time inside operators: a missing connection must only fail on first use.
    monkeypatch.delenv("AIRFLOW_CONN_NOT_THERE", raising=False)
    hook = SequinHook("not_there")
    assert hook.sequin_conn_id == "not_there" and hook._settings is None
    with pytest.raises(AirflowNotFoundException):
        _ = hook.settings


def test_settings_from_json_and_uri_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_SEQ_JSON",
        json.dumps(
            {
                "conn_type": "sequin",
                "host": "db.example",
                "port": 6543,
                "login": "rep",
                "password": "s3cret pw",
                "schema": "shop",
                "extra": {
                    "store_dsn": "postgresql://st@store.example/ops",
                    "store_schema": "cdc",
                    "config_path": "/etc/sequin.yaml",
                    "sslmode": "require",
                },
            }
        ),
    )
    settings = SequinHook("seq_json").settings
    assert conninfo_to_dict(settings.source_dsn) == {
        "host": "db.example",
        "port": "6543",
        "user": "rep",
        "password": "s3cret pw",
        "dbname": "shop",
        "connect_timeout": "10",
        "sslmode": "require",
    }
    assert (settings.store_dsn, settings.store_schema, settings.config_path) == (
        "postgresql://st@store.example/ops",
        "cdc",
        "/etc/sequin.yaml",
    )
    assert "s3cret" not in repr(settings)

    # URI form, no extras: the store is the source database, schema "sequin".
    monkeypatch.setenv("AIRFLOW_CONN_SEQ_URI", "sequin://rep:pw@db.example:5433/shop")
    uri = SequinHook("seq_uri").settings
    assert uri.store_dsn == uri.source_dsn and uri.store_schema == "sequin" and uri.config_path is None
    assert conninfo_to_dict(uri.source_dsn)["port"] == "5433"


def test_settings_accept_prefixed_extras() -> None:
    from airflow.sdk import Connection

    conn = Connection(
        conn_id="x",
        conn_type="sequin",
        host="h",
        schema="d",
        extra=json.dumps({"extra__sequin__store_schema": "old_ui", "store_dsn": ""}),
    )
    settings = SequinConnectionSettings.from_connection(conn)
    assert settings.store_schema == "old_ui"
    assert settings.store_dsn == settings.source_dsn  # an empty extra means "not set"
