"""Supervision of a stream app: its lock, its heartbeat watch and its restart budget (DESIGN §6, §10).

What ``SequinReplicationOperator`` decides while it keeps a stream app alive, without Airflow:

- ``StreamLock``: the advisory lock "one supervised stream app per database", held on a connection
  of its own, on which the supervisor also reads the app's heartbeat (``read_heartbeat``);
- ``HeartbeatWatch``: stall detection of one run, by *change* of ``stream_status.heartbeat_at`` on the
  supervisor's own monotonic clock (no clock skew with the driver);
- ``RestartBudget``: consecutive restarts with an exponential backoff, reset after a healthy run;
- ``effective_stall_timeout``: the stall timeout that makes sense for a database's heartbeat interval.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from sequin_provider import store
from sequin_provider.backoff import exponential_backoff
from sequin_provider.exceptions import SupervisionError
from sequin_provider.session_lock import SessionLock

log = logging.getLogger(__name__)


def lock_name(schema: str, database: str) -> str:
    """Text of the advisory lock of a database's stream app (hashed by ``hashtext``)."""
    return f"sequin-stream:{schema}:{database}"


class StreamLock(SessionLock):
    """The advisory lock "one supervised stream app per database", held by its own connection."""

    def __init__(self, dsn: str, schema: str, database: str, application_name: str = "sequin-supervisor") -> None:
        super().__init__(dsn, lock_name(schema, database), application_name)
        self.schema = schema
        self.database = database

    def heartbeat(self) -> datetime | None:
        """``stream_status.heartbeat_at`` of the database, read on the lock's connection (which also
        proves the lock is still held). Raises ``psycopg.OperationalError`` if the connection is lost."""
        assert self.conn is not None
        rows = [r for r in store.read_status(self.conn, self.schema) if r["database"] == self.database]
        return rows[0]["heartbeat_at"] if rows else None

    def read_heartbeat(self) -> datetime | None:
        """The heartbeat, taking the lock again first if its connection was lost; None when the store
        is unreachable (a warning is logged; the connection is dropped, to be re-locked next time).
        ``SupervisionError`` if another session took the lock meanwhile."""
        try:
            if self.conn is None and not self.acquire():
                raise SupervisionError(
                    f"lost the advisory lock of database {self.database!r} and another session"
                    f" took it ({self.holder()}): stopping this supervisor"
                )
            return self.heartbeat()
        except psycopg.Error as exc:
            log.warning("store unreachable, heartbeat not checked: %s", str(exc).strip())
            self.release()
            return None


@dataclass
class HeartbeatWatch:
    """Stall detection of one app run, by change of the heartbeat on the supervisor's own clock.

    :param started: monotonic time the run started.
    :param baseline: the heartbeat recorded before the run (a previous run's): not a sign of life.
    """

    start_timeout: float
    stall_timeout: float
    started: float
    baseline: Any = None
    last_value: Any = field(init=False, default=None)
    first_beat: float | None = field(init=False, default=None)
    last_beat: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.last_value = self.baseline

    def observe(self, value: Any, now: float) -> None:
        """Record a reading of the heartbeat (None: no reading, e.g. the store was unreachable)."""
        if value is not None and value != self.last_value:
            self.last_value = value
            self.last_beat = now
            if self.first_beat is None:
                self.first_beat = now

    def stalled(self, now: float) -> bool:
        """No first heartbeat within ``start_timeout``, or none for ``stall_timeout`` since the last."""
        if self.last_beat is None:
            return now - self.started > self.start_timeout
        return now - self.last_beat > self.stall_timeout

    def stall_reason(self, now: float) -> str:
        """Why the run counts as stalled, in words."""
        waited = "first" if self.last_beat is None else "new"
        return f"stalled (no {waited} heartbeat for {now - (self.last_beat or self.started):.0f}s)"

    def healthy_for(self, now: float) -> float:
        """Seconds since the run's first heartbeat (0 if none)."""
        return 0.0 if self.first_beat is None else now - self.first_beat


def backoff_delay(restart: int, initial: float, maximum: float) -> float:
    """Delay before restart number ``restart`` (1-based): ``initial`` doubling, capped at ``maximum``."""
    return exponential_backoff(restart, initial, maximum)


@dataclass
class RestartBudget:
    """Consecutive restarts of an app: each waits longer (``backoff_delay``); after ``max_restarts``
    in a row the supervisor gives up; a run healthy for ``reset_after`` seconds starts the count again."""

    max_restarts: int
    initial_backoff: float
    max_backoff: float
    reset_after: float
    consecutive: int = 0

    def next_delay(self, healthy_for: float) -> float | None:
        """Count a restart after a run that was healthy for ``healthy_for`` seconds: the delay before
        it, or None when the budget is spent (``max_restarts`` consecutive restarts already)."""
        if healthy_for >= self.reset_after:
            self.consecutive = 0
        self.consecutive += 1
        if self.consecutive > self.max_restarts:
            return None
        return backoff_delay(self.consecutive, self.initial_backoff, self.max_backoff)


def effective_stall_timeout(stall_timeout: float | None, heartbeat_interval: float) -> tuple[float, str | None]:
    """The stall timeout to watch with (0: only exits count) and a warning about it, if any: an idle
    stream records no heartbeats without a ``heartbeat_interval``, and a timeout close to the interval
    restarts healthy idle apps."""
    stall = float(stall_timeout or 0)
    if stall and heartbeat_interval <= 0:
        return 0.0, "heartbeat_interval 0: an idle stream records no heartbeats, so only exits of the app are watched"
    if stall and stall < 3 * heartbeat_interval:
        return stall, (
            f"stall_timeout {stall:.0f}s is close to heartbeat_interval {heartbeat_interval:.0f}s: an idle"
            " but healthy app may be restarted"
        )
    return stall, None
