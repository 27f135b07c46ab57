"""The view's actions on the buffer of parked messages: retry now, discard, requeue.

Each is the code the CLI and the Airflow operator run, not a copy: a retry is
``sinks.retry.retry_sinks`` (``sequin buffer retry``, ``SequinBufferRetryOperator``) after the
group's parked messages are made due now (a retry by hand does not wait for the backoff); discard
and requeue are ``store.set_buffered_state`` (``sequin buffer discard`` / ``requeue``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from sequin_provider.config import SequinConfig
from sequin_provider.exceptions import SequinError

ACTIONS = ("retry", "discard", "requeue")


class ActionError(SequinError):
    """An action the view cannot run: an unknown action or sink."""


@dataclass(frozen=True)
class ActionResult:
    """What an action did, for the page: one line, and the counts behind it."""

    action: str
    sink: str
    group: str | None
    message: str
    counts: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """The JSON the page receives."""
        return {
            "action": self.action,
            "sink": self.sink,
            "group": self.group,
            "message": self.message,
            "counts": self.counts,
        }


def run_action(config: SequinConfig, action: str, sink: str, group: str | None = None) -> ActionResult:
    """Run ``action`` on ``sink``'s buffered messages (one group's when ``group`` is given; a retry
    then delivers the sink's other due messages too, as ``sequin buffer retry`` does)."""
    from sequin_provider import store

    if action not in ACTIONS:
        raise ActionError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
    if not config.has_sink(sink):
        raise ActionError(f"no sink named {sink!r}")
    schema = config.store.schema
    with psycopg.connect(config.store_dsn(config.sink(sink).database), connect_timeout=10) as conn:
        if action == "retry":
            store.make_parked_due(conn, schema, sink, group)
        else:
            changed = store.set_buffered_state(
                conn, schema, sink, "discarded" if action == "discard" else "parked", group
            )
            verb = "discarded" if action == "discard" else "requeued"
            return ActionResult(action, sink, group, f"{changed} messages {verb}", {verb: changed})
    from sequin_provider.sinks.retry import retry_sinks

    (report,) = retry_sinks(config, sink)
    counts = {
        "delivered": report.delivered,
        "filtered": report.filtered,
        "failed": report.failed,
        "discarded": report.discarded,
        "still_parked": report.still_parked,
    }
    return ActionResult(action, sink, group, report.line(), counts)
