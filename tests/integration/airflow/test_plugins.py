"""The Airflow plugin: the stream API and the Sequin view mounted as Airflow mounts ``fastapi_apps``;
the view's token handling (a form and an HttpOnly cookie, never a URL), its data and its buffer actions.
The view in a real browser: ``test_view_browser.py``."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import threading
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sequin_provider import store, stream_queue
from sequin_provider.plugins.sequin import URL_PREFIX, LazySequinApp, SequinPlugin
from sequin_provider.plugins.view_data import backfill_entry
from tests.support.receiver import Receiver
from tests.support.view import running_backfill, view_config


def test_plugin_is_registered_and_declares_the_app_and_the_view() -> None:
    (entry,) = [e for e in metadata.entry_points(group="airflow.plugins") if e.name == "sequin"]
    assert entry.load() is SequinPlugin
    (app,) = SequinPlugin.fastapi_apps
    assert app["url_prefix"] == URL_PREFIX and isinstance(app["app"], LazySequinApp)
    (view,) = SequinPlugin.external_views
    assert view["href"] == f"{URL_PREFIX}/ui/" and view["destination"] == "nav"


def _config_with_a_message(dsn: str, dbname: str, tmp_path: Path, url: str = "http://127.0.0.1:9/hook") -> Path:
    config = view_config(dsn, dbname, tmp_path, url)
    with psycopg.connect(dsn) as conn:
        store.insert_stream_messages(conn, "sequin", [("kv_stream", 5, 0, "g", "5:0", '{"record": {"k": 1}}')])
        store.advance_visible_lsn(conn, "sequin", ["kv_stream"], 5)
    return config


def _token(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        token = stream_queue.create_token(conn, "sequin", "ui")
        conn.commit()
    return token


@pytest.fixture
def airflow_like() -> Iterator[FastAPI]:
    """An app that mounts the plugin's as Airflow mounts ``fastapi_apps`` (no lifespan reaches it);
    closed afterwards, so its LISTEN thread does not outlive the test's database."""
    plugin = LazySequinApp()
    app = FastAPI()
    app.mount(URL_PREFIX, plugin)
    yield app
    plugin.close()
    assert not [t for t in threading.enumerate() if t.name == "sequin-api-listen"], "close() left a LISTEN thread"


def test_mounted_app_serves_the_api_and_the_view(
    dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_like: FastAPI
) -> None:
    monkeypatch.setenv("SEQUIN_CONFIG", str(_config_with_a_message(dsn, dbname, tmp_path)))
    token = _token(dsn)
    with TestClient(airflow_like) as client:
        assert "<form" in client.get(f"{URL_PREFIX}/ui/").text  # no token: asks for one
        refused = client.post(f"{URL_PREFIX}/ui/login", data={"token": "sqn_nope"})
        assert (
            refused.status_code == 401 and "unknown API token" in refused.text and "sequin_token" not in client.cookies
        )
        login = client.post(f"{URL_PREFIX}/ui/login", data={"token": token}, follow_redirects=False)
        assert login.status_code == 303 and login.headers["location"] == "./"
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and f"Path={URL_PREFIX}/ui" in cookie
        page = client.get(f"{URL_PREFIX}/ui/")
        assert (
            page.status_code == 200 and "view.js" in page.text and '<form method="post" action="logout">' in page.text
        )
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "textContent" in client.get(f"{URL_PREFIX}/ui/view.js").text
        data = client.get(f"{URL_PREFIX}/ui/data").json()
        (db,) = data["databases"]
        assert db["slot"] == f"slot_{dbname}" and db["active"] is False and isinstance(db["lag_bytes"], int)
        sinks = {s["name"]: s for s in data["sinks"]}
        assert sinks["kv_stream"]["counts"]["visible"] == 1 and sinks["kv_hook"]["parked"] == 0
        got = client.post(
            f"{URL_PREFIX}/api/sequin_streams/kv_stream/receive",
            json={"batch_size": 5},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert got.status_code == 200 and [m["data"]["record"] for m in got.json()["data"]] == [{"k": 1}]
        assert client.post(f"{URL_PREFIX}/api/sequin_streams/kv_stream/receive").status_code == 401
        out = client.post(f"{URL_PREFIX}/ui/logout", follow_redirects=False)
        assert out.status_code == 303 and "sequin_token" not in client.cookies
        assert "<form" in client.get(f"{URL_PREFIX}/ui/").text


def test_a_token_in_the_url_is_never_accepted(
    dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_like: FastAPI
) -> None:
    monkeypatch.setenv("SEQUIN_CONFIG", str(_config_with_a_message(dsn, dbname, tmp_path)))
    token = _token(dsn)
    with TestClient(airflow_like) as client:
        page = client.get(f"{URL_PREFIX}/ui/", params={"token": token})
        assert "<form" in page.text and "not accepted in URLs" in page.text and "view.js" not in page.text
        assert "set-cookie" not in page.headers and "sequin_token" not in client.cookies
        assert client.get(f"{URL_PREFIX}/ui/data", params={"token": token}).status_code == 401
        assert client.post(f"{URL_PREFIX}/ui/login", params={"token": token}).status_code == 401  # only the form's
        action = {"action": "discard", "sink": "kv_hook"}
        assert client.post(f"{URL_PREFIX}/ui/action", params={"token": token}, json=action).status_code == 401


def test_view_lists_parked_messages_and_runs_actions_as_the_cli_does(
    dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_like: FastAPI
) -> None:
    receiver = Receiver().start()
    try:
        monkeypatch.setenv("SEQUIN_CONFIG", str(_config_with_a_message(dsn, dbname, tmp_path, receiver.url)))
        evil = "<img src=x onerror=alert(1)> HTTP 500"
        with psycopg.connect(dsn) as conn:
            store.park_messages(
                conn,
                "sequin",
                [
                    store.ParkRow("kv_hook", 100, 0, "g1", "k1", json.dumps({"n": 1}), None, 1, evil, delay=600.0),
                    store.ParkRow("kv_hook", 101, 0, "g2", "k2", json.dumps({"n": 2}), None, 1, "HTTP 503"),
                ],
            )
        with TestClient(airflow_like) as client:
            client.post(f"{URL_PREFIX}/ui/login", data={"token": _token(dsn)})
            data = client.get(f"{URL_PREFIX}/ui/data").json()
            assert [(m["group"], m["state"], m["error"]) for m in data["buffered"]] == [
                ("g1", "parked", evil),  # data for the script (which renders it as text), not markup
                ("g2", "parked", "HTTP 503"),
            ]
            assert {s["name"]: s["parked"] for s in data["sinks"]} == {"kv_stream": 0, "kv_hook": 2}
            as_form = client.post(f"{URL_PREFIX}/ui/action", data={"action": "retry", "sink": "kv_hook"})
            assert as_form.status_code == 415  # what a cross-site form could send is refused
            bad = client.post(f"{URL_PREFIX}/ui/action", json={"action": "explode", "sink": "kv_hook"})
            assert bad.status_code == 400 and "unknown action" in bad.json()["detail"]
            assert client.post(f"{URL_PREFIX}/ui/action", json={"action": "retry", "sink": "nope"}).status_code == 400
            # g1 is not due for 10 minutes: a retry by hand does not wait for its backoff
            retried = client.post(f"{URL_PREFIX}/ui/action", json={"action": "retry", "sink": "kv_hook", "group": "g1"})
            assert retried.status_code == 200 and retried.json()["counts"]["delivered"] == 2
            assert sorted(m["n"] for m in receiver.messages()) == [1, 2]
            with psycopg.connect(dsn) as conn:
                store.park_messages(
                    conn, "sequin", [store.ParkRow("kv_hook", 102, 0, "g3", "k3", "{}", None, 1, "HTTP 500")]
                )
            gone = client.post(f"{URL_PREFIX}/ui/action", json={"action": "discard", "sink": "kv_hook", "group": "g3"})
            assert gone.json()["message"] == "1 messages discarded"
            (discarded,) = client.get(f"{URL_PREFIX}/ui/data").json()["buffered"]
            assert discarded["state"] == "discarded" and "(discarded by hand)" in discarded["error"]
            back = client.post(f"{URL_PREFIX}/ui/action", json={"action": "requeue", "sink": "kv_hook", "group": "g3"})
            assert back.json()["counts"] == {"requeued": 1}
    finally:
        receiver.stop()


def test_backfill_entry_has_progress_rate_and_eta(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
        backfill_id = running_backfill(conn, "s", "t")
        entry = backfill_entry(store.get_backfill(conn, "sequin", backfill_id))
    assert (entry["rows_done"], entry["rows_total"], entry["percent"]) == (400, 1000, 40.0)
    assert (entry["rows_per_second"], entry["eta_seconds"]) == (10.0, 60)
    assert entry["progress"] == "running, 400/1,000 rows (40.0%), 10 rows/s, ETA 0:01:00"


def test_missing_config_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, airflow_like: FastAPI
) -> None:
    monkeypatch.setenv("SEQUIN_CONFIG", str(tmp_path / "absent.yaml"))
    with TestClient(airflow_like) as client:
        page = client.get(f"{URL_PREFIX}/ui/")
    assert page.status_code == 503 and "not configured" in page.text and "absent.yaml" in page.text
