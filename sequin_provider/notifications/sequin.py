"""``SequinNotifier``: POST an alert as JSON to a webhook (Slack-style relays, incident tools, ...).

Usable as ``on_failure_callback`` / ``on_success_callback`` of tasks and DAGs (sync ``notify``)
and awaitable in the triggerer, e.g. for deadline alerts (``async_notify``). A failed POST is
logged, never raised: an alert that cannot be delivered must not fail or retry the task it reports.
The log names the webhook's host only, since webhook URLs often embed a secret token.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping, Sequence
from urllib.parse import urlsplit

import httpx
from airflow.sdk import BaseNotifier

if TYPE_CHECKING:
    from airflow.sdk import Context


def webhook_host(url: str) -> str:
    """``scheme://host[:port]`` of a URL, for logs (the path may hold a secret)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}" if parts.netloc else "<invalid url>"


def context_fields(context: Mapping[str, Any]) -> dict[str, Any]:
    """What the alert says about where it comes from (task callbacks have a ``ti``, DAG callbacks not)."""
    ti = context.get("ti") or context.get("task_instance")
    dag_run = context.get("dag_run")
    logical_date = context.get("logical_date")
    exception = context.get("exception")
    state = getattr(ti, "state", None) if ti is not None else getattr(dag_run, "state", None)
    return {
        "dag_id": getattr(context.get("dag"), "dag_id", None)
        or getattr(ti, "dag_id", None)
        or getattr(dag_run, "dag_id", None),
        "task_id": getattr(ti, "task_id", None) or getattr(context.get("task"), "task_id", None),
        "run_id": context.get("run_id") or getattr(dag_run, "run_id", None) or getattr(ti, "run_id", None),
        "map_index": getattr(ti, "map_index", None),
        "try_number": getattr(ti, "try_number", None),
        "logical_date": logical_date.isoformat() if isinstance(logical_date, datetime) else logical_date,
        "state": None if state is None else str(getattr(state, "value", state)),
        "exception": None
        if exception is None
        else f"{type(exception).__name__}: {exception}"
        if isinstance(exception, BaseException)
        else str(exception),
    }


class SequinNotifier(BaseNotifier):
    """POSTs ``{"title", "message", "dag_id", "task_id", "run_id", ...}`` as JSON to ``url``.

    :param url: the webhook (templated).
    :param message: the alert text (templated); default: what happened to which task/run.
    :param title: a short title (templated).
    :param details: extra JSON fields added to the payload under ``details``.
    :param headers: extra HTTP headers (e.g. an authorization token).
    :param timeout: seconds before the POST gives up.
    """

    template_fields: Sequence[str] = ("url", "message", "title")

    def __init__(
        self,
        *,
        url: str,
        message: str | None = None,
        title: str = "Sequin alert",
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        super().__init__()
        self.url = url
        self.message = message
        self.title = title
        self.details = details or {}
        self.headers = headers or {}
        self.timeout = timeout

    def build_payload(self, context: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON body for ``context``."""
        fields = context_fields(context)
        message = self.message
        if not message:
            what = f"task {fields['task_id']}" if fields["task_id"] else "DAG"
            outcome = fields["exception"] or fields["state"] or "notification"
            message = f"{what} of {fields['dag_id']} (run {fields['run_id']}): {outcome}"
        return {
            "title": self.title,
            "message": message,
            **fields,
            "details": self.details,
            "sent_at": datetime.now(timezone.utc).isoformat(),
        }

    def notify(self, context: Context) -> None:
        """Send the alert (sync: task and DAG callbacks)."""
        self.send(self.build_payload(context))

    async def async_notify(self, context: Context) -> None:
        """Send the alert (async: the triggerer)."""
        await self.asend(self.build_payload(context))

    def send(self, payload: dict[str, Any]) -> bool:
        """POST ``payload``; True if the webhook answered 2xx, else log why and return False."""
        if not self.url:
            return self._failed(payload, "no webhook URL configured")
        try:
            with httpx.Client(timeout=self.timeout) as client:
                response = client.post(self.url, json=payload, headers=self.headers)
            return self._check(response, payload)
        except Exception as exc:  # noqa: BLE001 - an undeliverable alert is logged, not raised
            return self._failed(payload, f"{type(exc).__name__}: {exc}")

    async def asend(self, payload: dict[str, Any]) -> bool:
        """Async ``send``."""
        if not self.url:
            return self._failed(payload, "no webhook URL configured")
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                response = await client.post(self.url, json=payload, headers=self.headers)
            return self._check(response, payload)
        except Exception as exc:  # noqa: BLE001 - an undeliverable alert is logged, not raised
            return self._failed(payload, f"{type(exc).__name__}: {exc}")

    def _check(self, response: httpx.Response, payload: dict[str, Any]) -> bool:
        if not response.is_success:
            return self._failed(payload, f"HTTP {response.status_code}: {response.text[:200]}")
        self.log.info(
            "Sent notification %r to %s (HTTP %d): %s",
            payload["title"],
            webhook_host(self.url),
            response.status_code,
            payload["message"],
        )
        return True

    def _failed(self, payload: dict[str, Any], reason: str) -> bool:
        self.log.error(
            "Could not send notification %r to %s: %s (message: %s)",
            payload["title"],
            webhook_host(self.url),
            reason,
            payload["message"],
        )
        return False


def alert_from_environment(title: str) -> SequinNotifier:
    """A failure alert for the bundled DAGs: to ``SEQUIN_ALERT_WEBHOOK_URL`` of the DAG processor's
    environment, else to the Airflow Variable ``sequin_alert_webhook_url`` (read at run time, so
    parsing the DAG reads nothing). With neither set, the alert is only logged."""
    url = os.environ.get("SEQUIN_ALERT_WEBHOOK_URL") or "{{ var.value.get('sequin_alert_webhook_url', '') }}"
    return SequinNotifier(url=url, title=title)
