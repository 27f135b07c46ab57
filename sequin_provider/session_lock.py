"""A session-level Postgres advisory lock held by a connection of its own.

"At most one of these at a time" across processes and hosts, with no lease to renew: Postgres
releases the lock when the holder's session ends, a crash or a lost host included. Used for one
supervised stream app per database and one running app per backfill.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

HELD_WHERE = (
    "l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtext(%s)::bigint"
)
"""``pg_locks l`` rows of a granted session-level advisory lock ``hashtext(%s)`` in this database."""


class SessionLock:
    """The advisory lock ``hashtext(name)`` in the database of ``dsn``.

    :param dsn: where the lock lives (the store).
    :param name: the lock's text; ``hashtext`` makes it a lock key.
    :param application_name: how the holder shows in ``pg_stat_activity`` (and in ``holder``).
    """

    def __init__(self, dsn: str, name: str, application_name: str = "sequin") -> None:
        self.dsn = dsn
        self.name = name
        self.application_name = application_name[:63]
        self.conn: psycopg.Connection[Any] | None = None

    def acquire(self) -> bool:
        """Take the lock on a new connection; False (and no connection kept) if another session holds it."""
        self.release()
        conn = psycopg.connect(
            self.dsn,
            autocommit=True,
            connect_timeout=10,
            application_name=self.application_name,
            keepalives=1,
            keepalives_idle=30,
            keepalives_interval=10,
            keepalives_count=3,
        )
        try:
            got = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (self.name,)).fetchone()[0]  # type: ignore[index]
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            return False
        self.conn = conn
        return True

    def acquire_within(self, timeout: float, interval: float = 1.0) -> bool:
        """``acquire``, tried again until ``timeout`` seconds have passed (a holder that is stopping)."""
        deadline = time.monotonic() + timeout
        while not self.acquire():
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)
        return True

    def held_elsewhere(self) -> bool:
        """Whether another session holds the lock now (taken and let go at once when it is free)."""
        if self.conn is not None:
            return False
        if self.acquire():
            self.release()
            return False
        return True

    def seen_held(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether some session holds the lock now, asked on ``conn`` (any connection to its database)
        without trying to take it: a look that never makes the holder-to-be fail its own ``acquire``."""
        row = conn.execute(f"SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {HELD_WHERE})", (self.name,)).fetchone()
        return bool(row and row[0])

    def holder(self) -> str:
        """Who holds the lock (pid, application name, client, since when), for error messages."""
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10) as conn:
                row = conn.execute(
                    "SELECT a.pid, a.application_name, a.client_addr, a.backend_start FROM pg_locks l"
                    f" JOIN pg_stat_activity a ON a.pid = l.pid WHERE {HELD_WHERE}",
                    (self.name,),
                ).fetchone()
        except psycopg.Error as exc:
            return f"unknown holder ({str(exc).strip()})"
        if row is None:
            return "a session that has released it since"
        pid, app, client, since = row
        return (
            f"server pid {pid}, {app or 'no application name'!r}, from {client or 'local socket'},"
            f" since {since:%Y-%m-%d %H:%M:%S%z}"
        )

    def release(self) -> None:
        """Close the connection: the session ends and the lock with it."""
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None
