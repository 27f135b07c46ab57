"""The persistent buffer of parked messages (DESIGN §2.4, §9) and its retry.

A message that a sink refuses (non-2xx, timeout, connection error), whose transform raises, or
whose change the sink's filter fails on (a runtime error of the engine, such as an invalid cast) is
parked here with its error and attempt count, and so is every later message of its group, so the
stream's micro-batch completes and the slot advances while the group keeps its order. ``retry``
redelivers due groups one message at a time in position order, with exponential backoff
(1 s x 2^(n-1), +/-15 % jitter, capped); after ``max_retry_count`` attempts a message is kept as
``discarded`` with its last error and its group moves on. Nothing is ever dropped silently.
A parked truncate is a barrier for its table (docs/stream-behaviour.md: TRUNCATE): the retry
delivers it only after the earlier parked messages of its table, and their later ones after it.
The buffer's queries are ``store.buffer``'s; this module is the retry (its policy, its per-sink
lock, delivery and rendering) and the rules of what is parked.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import psycopg

from sequin_provider.backoff import exponential_backoff
from sequin_provider.config import SequinConfig, SinkConfig
from sequin_provider.exceptions import DeliveryError
from sequin_provider.store import (
    Parked,
    behind_barrier,
    count_parked,
    due_parked_groups,
    parked_barriers,
    parked_group_messages,
    parked_heads,
    record_parked_failure,
    remove_parked,
)

log = logging.getLogger(__name__)

BACKOFF_BASE = 1.0
BACKOFF_CAP = 300.0
JITTER = 0.15
FOLLOWER_ERROR = "waiting behind an earlier parked message of its group"
BARRIER_ERROR = "waiting behind an earlier parked message of its table (a truncate is a barrier for its table)"
CHANGE_SOURCE_PREFIX = "change:"
"""``source`` of a message parked because the sink's filter failed on its change: this prefix and the
change row as JSON (``change_source``), kept to evaluate the filter again on retry. The ``source``
of a failed transform is a message (JSON, which never starts with a letter other than those of
``true``/``false``/``null``), so the prefix tells the two apart."""


def change_source(change: dict[str, Any]) -> str:
    """The ``source`` of a message whose filter failed: its change row (``messages.CHANGE_COLUMNS``)."""
    return CHANGE_SOURCE_PREFIX + json.dumps(change, separators=(",", ":"), ensure_ascii=False)


def parked_change(source: str | None) -> dict[str, Any] | None:
    """The change row kept in a parked message's ``source`` (``change_source``), or None when the
    message was parked after its filter (its ``source``, if any, is the message before its transform)."""
    if source is None or not source.startswith(CHANGE_SOURCE_PREFIX):
        return None
    return json.loads(source[len(CHANGE_SOURCE_PREFIX) :])  # type: ignore[no-any-return]


def backoff_seconds(attempts: int, rng: random.Random | None = None) -> float:
    """Delay before attempt ``attempts + 1``: 1 s x 2^(attempts-1), +/-15 % jitter, capped."""
    return exponential_backoff(attempts, BACKOFF_BASE, BACKOFF_CAP, JITTER, rng)


def parked_groups(conn: psycopg.Connection[Any], schema: str, sink: str, groups: Iterable[str]) -> set[str]:
    """Which of ``groups`` have parked messages in ``sink`` (their next messages must be parked too)."""
    return set(parked_heads(conn, schema, sink, groups))


# ---------------------------------------------------------------------------------------------
# Retry


# ``DeliveryError`` (a sink did not take a message) is defined in ``exceptions``.


class FilterFailed(RuntimeError):
    """The sink's filter, evaluated again on a parked change, failed again (its text says why)."""


class Filtered(Exception):
    """The sink's filter, evaluated again on a parked change, does not take it: the message is
    dropped from the buffer (counted as filtered, not delivered)."""


Deliver = Callable[["Parked", str], None]
"""Delivers one parked message (its rendered form given) or raises DeliveryError."""

Render = Callable[["Parked"], str]
"""The rendered form of a parked message that has none (``data`` is None): its transform applied
again, or its change run through the sink's filter again; raises ``Filtered`` when the filter
no longer takes it, ``FilterFailed`` or the transform's error when it fails again."""


@dataclass
class RetryReport:
    """What one retry run did for a sink."""

    sink: str
    delivered: int = 0
    filtered: int = 0
    failed: int = 0
    discarded: int = 0
    still_parked: int = 0
    skipped: str | None = None
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One line for logs and the CLI."""
        if self.skipped:
            return f"{self.sink}: skipped ({self.skipped})"
        return (
            f"{self.sink}: delivered {self.delivered}, filtered {self.filtered}, failed again {self.failed},"
            f" discarded {self.discarded}, still parked {self.still_parked}"
        )


def retry_sink(
    config: SequinConfig, sink: SinkConfig, deliver: Deliver, render: Render | None = None, workers: int = 8
) -> RetryReport:
    """Redeliver ``sink``'s due parked messages group by group, in order (one retry run per sink at a
    time); a message dropped by the sink's filter (``Filtered``) lets its group move on."""
    report = RetryReport(sink.name)
    schema = config.store.schema
    dsn = config.store_dsn(sink.database)
    lock = threading.Lock()
    local = threading.local()
    connections: list[psycopg.Connection[Any]] = []

    def connection() -> psycopg.Connection[Any]:
        if getattr(local, "conn", None) is None:
            local.conn = psycopg.connect(dsn, connect_timeout=10)
            with lock:
                connections.append(local.conn)
        return local.conn  # type: ignore[no-any-return]

    barriers = False  # whether any parked truncate of this sink makes a barrier (checked per message then)
    held: set[str] = set()  # groups that stopped at a barrier in this round

    def retry_group(group: str) -> None:
        conn = connection()
        for message in parked_group_messages(conn, schema, sink.name, group):
            if barriers and behind_barrier(conn, schema, message):
                with lock:
                    held.add(group)
                return  # its table's barrier is not passed yet: a later round, or the next run
            try:
                data = message.data if message.data is not None else (render(message) if render else None)
                if data is None:
                    raise DeliveryError("the message has no rendered form")
                deliver(message, data)
            except Filtered:
                remove_parked(conn, schema, message)
                log.info(
                    "sink %s: parked change %s:%s dropped, the sink's filter no longer takes it",
                    sink.name,
                    message.commit_lsn,
                    message.commit_idx,
                )
                with lock:
                    report.filtered += 1
                continue
            except Exception as exc:  # noqa: BLE001 - DeliveryError, FilterFailed, a transform's error
                attempts = message.attempts + 1
                give_up = sink.max_retry_count is not None and attempts >= sink.max_retry_count
                record_parked_failure(
                    conn,
                    schema,
                    message,
                    str(exc) if isinstance(exc, (DeliveryError, FilterFailed)) else f"{type(exc).__name__}: {exc}",
                    give_up,
                    backoff_seconds(attempts),
                )
                with lock:
                    if give_up:
                        report.discarded += 1
                    else:
                        report.failed += 1
                        if len(report.errors) < 10:
                            report.errors.append(f"{group}: {exc}")
                if not give_up:
                    return  # the group waits for its next attempt
                continue
            remove_parked(conn, schema, message)
            with lock:
                report.delivered += 1

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as guard:
        got = guard.execute(
            "SELECT pg_try_advisory_lock(hashtext('sequin-retry:' || %s || ':' || %s))", (schema, sink.name)
        ).fetchone()
        if not got or not got[0]:
            report.skipped = "another retry of this sink is running"
            return report
        try:
            groups = due_parked_groups(guard, schema, sink.name)
            barriers = bool(parked_barriers(guard, schema, sink.name)[0])
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"retry-{sink.name}") as pool:
                while groups:
                    # Groups go concurrently; with a truncate parked, a group may stop at its table's
                    # barrier until the groups ahead of it are delivered: another round then, as long
                    # as the last one delivered something.
                    held.clear()
                    before = report.delivered + report.discarded
                    list(pool.map(retry_group, groups))
                    progressed = report.delivered + report.discarded > before
                    groups = (
                        [g for g in due_parked_groups(guard, schema, sink.name) if g in held]
                        if held and progressed
                        else []
                    )
            report.still_parked = count_parked(guard, schema, sink.name)
        finally:
            guard.execute(
                "SELECT pg_advisory_unlock(hashtext('sequin-retry:' || %s || ':' || %s))", (schema, sink.name)
            )
            for conn in connections:
                conn.close()
    return report
