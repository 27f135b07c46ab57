"""Supervision of a long-lived app: its lock, its sign of life, its restarts (DESIGN §6, §10).

What a supervising operator decides while it keeps an app alive, without Airflow:

- ``SupervisorLock``: the advisory lock "one supervisor of this app per database", held on a
  connection of its own, on which the supervisor also reads the app's sign of life
  (``read_heartbeat``); ``StreamLock`` (the stream app: ``stream_status.heartbeat_at``) and
  ``BackfillServerSupervisorLock`` (the backfill server: its own lock seen held) are its two kinds;
- ``HeartbeatWatch``: stall detection of one run, by *change* of the sign of life on the
  supervisor's own monotonic clock (no clock skew with the driver);
- ``RestartBudget``: consecutive restarts with an exponential backoff, reset after a healthy run;
- ``Supervisor``: the loop that runs an app, watches its exit and its sign of life and restarts it
  within that budget (``SupervisedAppOperator`` runs it for both apps);
- ``effective_stall_timeout``: the stall timeout that makes sense for a database's heartbeat interval.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Protocol

import psycopg

from sequin_provider import store
from sequin_provider.backoff import exponential_backoff
from sequin_provider.exceptions import SupervisionError
from sequin_provider.session_lock import SessionLock

log = logging.getLogger(__name__)


def lock_name(schema: str, database: str) -> str:
    """Text of the advisory lock of a database's stream app (hashed by ``hashtext``)."""
    return f"sequin-stream:{schema}:{database}"


def backfill_server_supervisor_lock_name(schema: str, database: str) -> str:
    """Text of the advisory lock "one supervised backfill server per database"."""
    return f"sequin-backfill-supervisor:{schema}:{database}"


class SupervisorLock(SessionLock):
    """A supervisor's advisory lock, held by its own connection, on which it also reads the sign of
    life of the app it supervises (``sign_of_life``, defined by each kind)."""

    def __init__(self, dsn: str, name: str, schema: str, database: str, application_name: str) -> None:
        super().__init__(dsn, name, application_name)
        self.schema = schema
        self.database = database

    def sign_of_life(self) -> Any:
        """The app's latest sign of life, read on the lock's connection (None: none yet). A new value
        is a heartbeat. Raises ``psycopg.OperationalError`` if the connection is lost."""
        raise NotImplementedError

    def read_heartbeat(self) -> Any:
        """``sign_of_life``, taking the lock again first if its connection was lost; None when the store
        is unreachable (a warning is logged; the connection is dropped, to be re-locked next time).
        ``SupervisionError`` if another session took the lock meanwhile."""
        try:
            if self.conn is None and not self.acquire():
                raise SupervisionError(
                    f"lost the advisory lock of database {self.database!r} and another session"
                    f" took it ({self.holder()}): stopping this supervisor"
                )
            return self.sign_of_life()
        except psycopg.Error as exc:
            log.warning("store unreachable, heartbeat not checked: %s", str(exc).strip())
            self.release()
            return None


class StreamLock(SupervisorLock):
    """The advisory lock "one supervised stream app per database"; its sign of life is the app's
    heartbeat in the store."""

    def __init__(self, dsn: str, schema: str, database: str, application_name: str = "sequin-supervisor") -> None:
        super().__init__(dsn, lock_name(schema, database), schema, database, application_name)

    def heartbeat(self) -> datetime | None:
        """``stream_status.heartbeat_at`` of the database, read on the lock's connection (which also
        proves the lock is still held). Raises ``psycopg.OperationalError`` if the connection is lost."""
        assert self.conn is not None
        rows = [r for r in store.read_status(self.conn, self.schema) if r["database"] == self.database]
        return rows[0]["heartbeat_at"] if rows else None

    def sign_of_life(self) -> datetime | None:
        """The stream app's heartbeat."""
        return self.heartbeat()


class BackfillServerSupervisorLock(SupervisorLock):
    """The advisory lock "one supervised backfill server per database". The server records no
    heartbeat; what tells that it is up and reachable is its own lock (``server``: the lock
    ``sequin backfill serve`` takes, the one that makes backfills go to it) being held. Each reading
    that sees it held is a heartbeat (the store's clock): a server that never takes it, or loses it
    (its store connection gone), stops beating and counts as stalled."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        database: str,
        server: SessionLock,
        application_name: str = "sequin-backfill-supervisor",
    ) -> None:
        super().__init__(
            dsn, backfill_server_supervisor_lock_name(schema, database), schema, database, application_name
        )
        self.server = server

    def sign_of_life(self) -> datetime | None:
        """The store's clock when the server's lock is seen held, else None (looked at, never taken)."""
        assert self.conn is not None
        if not self.server.seen_held(self.conn):
            return None
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        return None if row is None else row[0]


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


class AppRun(Protocol):
    """One run of a supervised app (``operators.spark_submit.SparkSubmitRun``)."""

    pid: int | None

    @property
    def finished(self) -> bool: ...

    @property
    def succeeded(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    def failure(self) -> str: ...

    def stop(self, grace_period: float) -> int | None: ...

    def kill(self) -> None: ...


class SupervisorStopped(Exception):
    """The supervisor was told to stop (``Supervisor.stop``); its app was stopped."""


@dataclass(frozen=True)
class RestartPolicy:
    """How a supervisor watches and restarts its app (the operators' parameters of the same names)."""

    start_timeout: float = 600.0
    stall_timeout: float = 300.0
    max_restarts: int = 5
    restart_backoff: float = 10.0
    max_restart_backoff: float = 300.0
    reset_after: float = 600.0
    stop_grace_period: float = 60.0
    poll_interval: float = 5.0
    run_for: float | None = None


def never_fatal(run: AppRun) -> str | None:
    """No exit of the app makes restarting it pointless."""
    return None


class Supervisor:
    """Run an app, watch it and restart it: an exit, or a stall (no new sign of life within
    ``start_timeout`` of its start or ``stall_timeout`` of the previous one; 0: only exits count),
    restarts it after ``RestartBudget``'s backoff; out of budget, ``SupervisionError``.

    :param what: the app in words, for logs and errors ("the stream app of database 'app'").
    :param launch: starts a run of the app.
    :param sign_of_life: reads the app's sign of life (None: no reading).
    :param policy: timeouts, restart budget, polling, ``run_for``.
    :param fatal: why an exited run must not be restarted (e.g. another instance serves the
        database), or None; a fatal exit raises ``SupervisionError`` with it at once.
    """

    def __init__(
        self,
        what: str,
        launch: Callable[[], AppRun],
        sign_of_life: Callable[[], Any],
        policy: RestartPolicy,
        fatal: Callable[[AppRun], str | None] = never_fatal,
    ) -> None:
        self.what = what
        self.launch = launch
        self.sign_of_life = sign_of_life
        self.policy = policy
        self.fatal = fatal
        self.current: AppRun | None = None
        self.runs: list[AppRun] = []
        self.restarts = 0
        self._stopped = threading.Event()

    def run(self) -> int | None:
        """Supervise until ``run_for`` passed (the app is stopped; its exit code is returned), the
        budget is spent (``SupervisionError``) or ``stop`` is called (``SupervisorStopped``). The app
        is stopped whichever way this ends."""
        try:
            return self._supervise()
        finally:
            run, self.current = self.current, None
            if run is not None:
                run.stop(self.policy.stop_grace_period)

    def _supervise(self) -> int | None:
        p = self.policy
        started = time.monotonic()
        budget = RestartBudget(p.max_restarts, p.restart_backoff, p.max_restart_backoff, p.reset_after)
        while True:
            self._check_stopped()
            watch = HeartbeatWatch(float(p.start_timeout), p.stall_timeout, time.monotonic(), self.sign_of_life())
            self.current = run = self.launch()
            self.runs.append(run)
            log.info("%s started (pid %s)", self.what, run.pid)
            reason = None
            while reason is None:
                now = time.monotonic()
                if run.finished:
                    reason = "exited with 0 (stopped from outside)" if run.succeeded else f"exited ({run.failure()})"
                    run.kill()  # whatever it left behind in its process group
                    fatal = self.fatal(run)
                    if fatal:
                        self.current = None
                        raise SupervisionError(f"{self.what} {reason}: {fatal}; not restarting it")
                elif p.run_for is not None and now - started >= float(p.run_for):
                    log.info("run_for %.0fs reached: stopping %s", float(p.run_for), self.what)
                    self.current = None
                    return run.stop(p.stop_grace_period)
                else:
                    watch.observe(self.sign_of_life(), now)
                    if p.stall_timeout and watch.stalled(now):
                        reason = watch.stall_reason(now)
                        run.stop(p.stop_grace_period)
                if reason is None and self._stopped.wait(p.poll_interval):
                    self._check_stopped()
            self.current = None
            self._check_stopped()
            delay = budget.next_delay(watch.healthy_for(time.monotonic()))
            if delay is None:
                raise SupervisionError(f"{self.what} {reason}; giving up after {p.max_restarts} consecutive restarts")
            self.restarts += 1
            log.warning("%s %s; restart %d/%d in %.1fs", self.what, reason, budget.consecutive, p.max_restarts, delay)
            if self._stopped.wait(delay):
                self._check_stopped()

    def _check_stopped(self) -> None:
        if self._stopped.is_set():
            raise SupervisorStopped(f"the supervisor was stopped (on_kill): {self.what} was stopped")

    def stop(self) -> None:
        """Stop supervising: the app is stopped cleanly (SIGTERM, then SIGKILL after the grace period)
        and ``run`` raises ``SupervisorStopped``. Safe from another thread (``on_kill``)."""
        self._stopped.set()
        run = self.current
        if run is not None:
            run.stop(self.policy.stop_grace_period)
