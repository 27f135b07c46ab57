"""SequinNotifier posts JSON alerts to a real local HTTP server; undeliverable alerts are logged, not raised."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from airflow.sdk import DAG
from structlog.testing import capture_logs

from sequin_provider.notifications.sequin import SequinNotifier, webhook_host
from tests.support.airflow import Webhook


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    with Webhook() as hook:
        yield hook


def failure_context() -> dict[str, Any]:
    """What Airflow passes to a task's ``on_failure_callback`` (the parts the notifier reads)."""
    dag = DAG("sequin_monitoring", schedule=None)
    ti = SimpleNamespace(
        dag_id="sequin_monitoring", task_id="slot_lag", run_id="manual__1", try_number=2, map_index=-1, state="failed"
    )
    return {
        "dag": dag,
        "ti": ti,
        "task_instance": ti,
        "run_id": "manual__1",
        "exception": RuntimeError("slot 'sequin_slot' lags 5 GB"),
    }


def test_posts_rendered_json_as_a_failure_callback(webhook: Webhook) -> None:
    notifier = SequinNotifier(
        url=webhook.url + "/hooks/{{ dag.dag_id }}",
        title="Sequin: {{ ti.task_id }}",
        message="{{ ti.task_id }} failed in {{ dag.dag_id }}",
        details={"env": "test"},
        headers={"Authorization": "Bearer t0k3n"},
    )
    with capture_logs() as logs:
        notifier(failure_context())  # how Airflow invokes on_failure_callback
    (request,) = webhook.received
    assert request["path"] == "/hooks/sequin_monitoring"
    assert request["headers"]["Authorization"] == "Bearer t0k3n"
    body = request["json"]
    assert {
        k: body[k]
        for k in ("title", "message", "dag_id", "task_id", "run_id", "try_number", "state", "exception", "details")
    } == {
        "title": "Sequin: slot_lag",
        "message": "slot_lag failed in sequin_monitoring",
        "dag_id": "sequin_monitoring",
        "task_id": "slot_lag",
        "run_id": "manual__1",
        "try_number": 2,
        "state": "failed",
        "exception": "RuntimeError: slot 'sequin_slot' lags 5 GB",
        "details": {"env": "test"},
    }
    assert any(log["log_level"] == "info" and "Sent notification" in log["event"] for log in logs)


def test_default_message_says_what_happened(webhook: Webhook) -> None:
    SequinNotifier(url=webhook.url).notify(failure_context())
    assert webhook.received[0]["json"]["message"] == (
        "task slot_lag of sequin_monitoring (run manual__1): RuntimeError: slot 'sequin_slot' lags 5 GB"
    )


def test_async_notify_posts_too(webhook: Webhook) -> None:
    notifier = SequinNotifier(url=webhook.url + "/async", message="from the triggerer")
    notifier.context = failure_context()
    asyncio.run(_await(notifier))  # the triggerer awaits the notifier (async_notify)
    (request,) = webhook.received
    assert request["path"] == "/async" and request["json"]["message"] == "from the triggerer"


async def _await(notifier: SequinNotifier) -> None:
    await notifier


def test_failed_posts_are_logged_not_raised(webhook: Webhook) -> None:
    with capture_logs() as logs:
        SequinNotifier(url=webhook.url + "/fail/secret-token", message="m1").notify(failure_context())
        closed = SequinNotifier(url="http://127.0.0.1:1/secret-token", message="m2", timeout=2)
        closed.notify(failure_context())
        assert asyncio.run(closed.asend({"title": "t", "message": "m3"})) is False
    assert len(webhook.received) == 1  # the 500 was received, and not retried
    errors = [log["event"] for log in logs if log["log_level"] == "error"]
    assert len(errors) == 3
    assert "HTTP 500" in errors[0] and "m1" in errors[0]
    assert "ConnectError" in errors[1] and "m2" in errors[1]
    assert not any("secret-token" in e for e in errors)  # webhook paths often hold a secret


def test_webhook_host_hides_path_and_credentials() -> None:
    assert webhook_host("https://user:pw@hooks.example:8443/T0/B1/xyz?k=v") == "https://hooks.example:8443"
    assert webhook_host("not a url") == "<invalid url>"
