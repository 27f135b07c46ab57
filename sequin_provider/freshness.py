"""How fresh a sink is: the commit time through which every change of its database has reached it.

A *mark* pairs a time of the source's clock with a WAL position: ``take_mark`` reads the clock
(``at``), waits until the transactions in progress at that moment have finished (one that had taken
its commit timestamp but not yet written its commit record is among them), then reads the WAL insert
position (``lsn``). So every transaction with a commit timestamp at or before ``at`` has its commit
record before ``lsn``. Once the pipeline's confirmed position (the slot's ``confirmed_flush_lsn``,
which never passes what is not delivered or durably in the store, DESIGN §2.8) reaches ``lsn``,
every such change reached each sink of the database, delivered or parked; a sink with no message
parked below ``lsn`` is then *complete through* ``at``. Never ahead of what is delivered; behind by
the time the stream takes to pass the mark (a heartbeat interval or so when idle).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from sequin_provider.backfill.watermarks import wait_for_snapshot_horizon
from sequin_provider.pgoutput import lsn_to_int
from sequin_provider.replication import slot_info


@dataclass(frozen=True)
class Mark:
    """Every transaction that committed at or before ``at`` (source clock) has its commit record
    ending at or before WAL position ``lsn``."""

    at: datetime
    lsn: int


def take_mark(conn: psycopg.Connection[Any]) -> Mark:
    """A ``Mark`` of the source ``conn`` (autocommit) now."""
    at = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    wait_for_snapshot_horizon(conn)
    lsn = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]  # type: ignore[index]
    return Mark(at, lsn_to_int(lsn))


def wait_confirmed(
    conn: psycopg.Connection[Any], slot: str, lsn: int, timeout: float, interval: float = 0.5
) -> int | None:
    """The slot's confirmed position once it reaches ``lsn`` (polled every ``interval`` seconds), or
    None if it has not within ``timeout`` seconds (or the slot does not exist)."""
    deadline = time.monotonic() + timeout
    while True:
        info = slot_info(conn, slot)
        confirmed = None if info is None else info.confirmed_flush_lsn
        if confirmed is not None and confirmed >= lsn:
            return confirmed
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def sinks_parked_below(conn: psycopg.Connection[Any], schema: str, sinks: list[str], lsn: int) -> set[str]:
    """Those of ``sinks`` with a message parked (not yet delivered) at a position before ``lsn``."""
    rows = conn.execute(
        sql.SQL(
            "SELECT DISTINCT sink FROM {}.buffered_messages WHERE state = 'parked' AND sink = ANY(%s) AND commit_lsn < %s"
        ).format(sql.Identifier(schema)),
        (sinks, lsn),
    ).fetchall()
    return {r[0] for r in rows}


@dataclass(frozen=True)
class Freshness:
    """One measurement of a database: its ``mark``, the slot's confirmed position once it passed the
    mark (None: not within the wait), and which sinks are complete through ``mark.at``."""

    mark: Mark
    confirmed_lsn: int | None
    complete: tuple[str, ...]
    behind: tuple[str, ...]


def measure_freshness(
    source_dsn: str, store_dsn: str, schema: str, slot: str, sinks: list[str], timeout: float
) -> Freshness:
    """Take a mark on the source, wait (up to ``timeout`` seconds) for the pipeline to confirm it, and
    tell which of ``sinks`` are complete through it (none if it was not confirmed in time; those with
    a message parked before it are ``behind``)."""
    with psycopg.connect(source_dsn, autocommit=True, connect_timeout=10) as source:
        mark = take_mark(source)
        confirmed = wait_confirmed(source, slot, mark.lsn, timeout)
    if confirmed is None:
        return Freshness(mark, None, (), tuple(sinks))
    with psycopg.connect(store_dsn, autocommit=True, connect_timeout=10) as conn:
        parked = sinks_parked_below(conn, schema, sinks, mark.lsn)
    return Freshness(
        mark, confirmed, tuple(s for s in sinks if s not in parked), tuple(s for s in sinks if s in parked)
    )
