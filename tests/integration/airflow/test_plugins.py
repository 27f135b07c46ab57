"""The Airflow plugin: the stream API and the status page mounted as Airflow mounts ``fastapi_apps``."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sequin_provider import store, stream_queue
from sequin_provider.plugins.sequin import URL_PREFIX, LazySequinApp, SequinPlugin
from tests.support.config import write_config
from tests.support.postgres import execute


def test_plugin_is_registered_and_declares_the_app_and_the_view() -> None:
    (entry,) = [e for e in metadata.entry_points(group="airflow.plugins") if e.name == "sequin"]
    assert entry.load() is SequinPlugin
    (app,) = SequinPlugin.fastapi_apps
    assert app["url_prefix"] == URL_PREFIX and isinstance(app["app"], LazySequinApp)
    (view,) = SequinPlugin.external_views
    assert view["href"] == f"{URL_PREFIX}/ui/" and view["destination"] == "nav"


def test_mounted_app_serves_the_api_and_the_status_page(
    dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    execute(
        dsn,
        "CREATE TABLE kv (k int PRIMARY KEY, v int)",
        f"SELECT pg_create_logical_replication_slot('slot_{dbname}', 'pgoutput')",
    )
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}}}]
        sinks: [{{name: kv_stream, tables: [kv], destination: {{type: sequin_stream}}}}]
        """,
    )
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
        token = stream_queue.create_token(conn, "sequin", "ui")
        store.insert_stream_messages(conn, "sequin", [("kv_stream", 5, 0, "g", "5:0", '{"record": {"k": 1}}')])
        store.advance_visible_lsn(conn, "sequin", ["kv_stream"], 5)
    monkeypatch.setenv("SEQUIN_CONFIG", str(config))
    airflow_like = FastAPI()
    airflow_like.mount(URL_PREFIX, LazySequinApp())  # Airflow mounts plugin apps; they get no lifespan
    with TestClient(airflow_like) as client:
        assert "<form" in client.get(f"{URL_PREFIX}/ui/").text  # no token: asks for one
        assert "unknown API token" in client.get(f"{URL_PREFIX}/ui/", params={"token": "sqn_nope"}).text
        page = client.get(f"{URL_PREFIX}/ui/", params={"token": token})
        assert page.status_code == 200 and "kv_stream" in page.text and f"slot_{dbname}" in page.text
        assert "<td>1</td>" in page.text  # one visible message in kv_stream
        assert (
            client.get(f"{URL_PREFIX}/ui/").status_code == 200 and "kv_stream" in client.get(f"{URL_PREFIX}/ui/").text
        )
        got = client.post(
            f"{URL_PREFIX}/api/sequin_streams/kv_stream/receive",
            json={"batch_size": 5},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert got.status_code == 200 and [m["data"]["record"] for m in got.json()["data"]] == [{"k": 1}]
        assert client.post(f"{URL_PREFIX}/api/sequin_streams/kv_stream/receive").status_code == 401


def test_missing_config_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SEQUIN_CONFIG", str(tmp_path / "absent.yaml"))
    airflow_like = FastAPI()
    airflow_like.mount(URL_PREFIX, LazySequinApp())
    with TestClient(airflow_like) as client:
        page = client.get(f"{URL_PREFIX}/ui/")
    assert page.status_code == 503 and "not configured" in page.text and "absent.yaml" in page.text
