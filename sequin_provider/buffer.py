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
"""

from __future__ import annotations

import json
import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterable, Sequence

import psycopg
from psycopg import sql

from sequin_provider.backoff import exponential_backoff
from sequin_provider.config import SequinConfig, SinkConfig
from sequin_provider.exceptions import DeliveryError
from sequin_provider.store import ident

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
    return json.loads(source[len(CHANGE_SOURCE_PREFIX):])  # type: ignore[no-any-return]


def backoff_seconds(attempts: int, rng: random.Random | None = None) -> float:
    """Delay before attempt ``attempts + 1``: 1 s x 2^(attempts-1), +/-15 % jitter, capped."""
    return exponential_backoff(attempts, BACKOFF_BASE, BACKOFF_CAP, JITTER, rng)


@dataclass(frozen=True)
class ParkRow:
    """A message to park: ``data`` is the rendered message, or None with ``source``: the message
    before its transform when the transform failed, the change row (``change_source``) when the
    sink's filter failed on it."""

    sink: str
    commit_lsn: int
    commit_idx: int
    group_id: str
    idempotency_key: str
    data: str | None
    source: str | None
    attempts: int
    error: str
    delay: float = 0.0
    barrier: str | None = None  # a truncate's: the group-id prefix of its table (store migration 12)


@dataclass(frozen=True)
class Parked:
    """A message in the buffer."""

    sink: str
    commit_lsn: int
    commit_idx: int
    group_id: str
    idempotency_key: str
    data: str | None
    source: str | None
    state: str
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    barrier: str | None = None


COLUMNS = "sink, commit_lsn, commit_idx, group_id, idempotency_key, data, source, state, attempts, next_attempt_at," \
          " last_error, barrier"


def park(conn: psycopg.Connection[Any], schema: str, rows: Sequence[ParkRow]) -> int:
    """Durably park messages (a replayed batch parks nothing twice); returns how many are new."""
    if not rows:
        return 0
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(sql.SQL(
            "INSERT INTO {}.buffered_messages (sink, commit_lsn, commit_idx, group_id, idempotency_key, data, source,"
            " attempts, last_error, next_attempt_at, barrier)"
            " SELECT sink, lsn, idx, grp, key, data, source, attempts, err, now() + delay * interval '1 second', barrier"
            " FROM unnest(%s::text[], %s::bigint[], %s::int[], %s::text[], %s::text[], %s::text[], %s::text[],"
            " %s::int[], %s::text[], %s::float8[], %s::text[])"
            " AS r(sink, lsn, idx, grp, key, data, source, attempts, err, delay, barrier)"
            " ON CONFLICT DO NOTHING").format(ident(schema)),
            ([r.sink for r in rows], [r.commit_lsn for r in rows], [r.commit_idx for r in rows],
             [r.group_id for r in rows], [r.idempotency_key for r in rows], [r.data for r in rows],
             [r.source for r in rows], [r.attempts for r in rows], [r.error[:4000] for r in rows],
             [r.delay for r in rows], [r.barrier for r in rows]))
        return cur.rowcount


def parked_groups(conn: psycopg.Connection[Any], schema: str, sink: str, groups: Iterable[str]) -> set[str]:
    """Which of ``groups`` have parked messages in ``sink`` (their next messages must be parked too)."""
    return set(parked_heads(conn, schema, sink, groups))


def parked_heads(conn: psycopg.Connection[Any], schema: str, sink: str,
                 groups: Iterable[str]) -> dict[str, tuple[int, int]]:
    """For each of ``groups`` with parked messages in ``sink``, the position of its first one: a
    message of the group after it waits behind it; one before it (earlier in a batch whose later
    change was parked first) does not.

    Asked on every push of every batch, usually with thousands of groups and nothing parked: the
    sink's parked groups are read first (at most one more than asked about), and only when there
    are more of them than that are the groups sent to the store to match."""
    wanted = set(groups)
    if not wanted:
        return {}
    parked = conn.execute(sql.SQL("SELECT DISTINCT group_id FROM {}.buffered_messages WHERE sink = %s"
                                  " AND state = 'parked' LIMIT %s").format(ident(schema)),
                          (sink, len(wanted) + 1)).fetchall()
    asked = list(wanted) if len(parked) > len(wanted) else [g for (g,) in parked if g in wanted]
    rows = conn.execute(sql.SQL("SELECT DISTINCT ON (group_id) group_id, commit_lsn, commit_idx"
                                " FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
                                " AND group_id = ANY(%s) ORDER BY group_id, commit_lsn, commit_idx")
                        .format(ident(schema)), (sink, asked)).fetchall() if asked else []
    conn.commit()
    return {g: (int(lsn), int(idx)) for g, lsn, idx in rows}


def sinks_with_parked(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str]) -> set[str]:
    """Which of ``sinks`` have parked messages (one indexed probe per sink, in one round trip)."""
    if not sinks:
        return set()
    rows = conn.execute(sql.SQL("SELECT s FROM unnest(%s::text[]) s WHERE EXISTS (SELECT 1 FROM"
                                " {}.buffered_messages b WHERE b.sink = s AND b.state = 'parked')")
                        .format(ident(schema)), (list(sinks),)).fetchall()
    conn.commit()
    return {r[0] for r in rows}


def parked_barriers(conn: psycopg.Connection[Any], schema: str, sink: str,
                    prefixes: Iterable[str] = ()) -> tuple[set[str], set[str]]:
    """The barriers of ``sink``'s parked truncates (every later message of their tables must be
    parked behind them), and which of ``prefixes`` (the barriers of a batch's truncates) have any
    parked message (such a truncate must be parked behind it). Asked on every push: the first is
    one look at a partial index that holds only parked truncates."""
    barred = {r[0] for r in conn.execute(sql.SQL(
        "SELECT DISTINCT barrier FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
        " AND barrier IS NOT NULL").format(ident(schema)), (sink,)).fetchall()}
    held: set[str] = set()
    wanted = sorted(set(prefixes))
    if wanted:
        held = {r[0] for r in conn.execute(sql.SQL(
            "SELECT p FROM unnest(%s::text[]) p WHERE EXISTS (SELECT 1 FROM {}.buffered_messages b"
            " WHERE b.sink = %s AND b.state = 'parked' AND starts_with(b.group_id, p))").format(ident(schema)),
            (wanted, sink)).fetchall()}
    conn.commit()
    return barred, held


def behind_barrier(conn: psycopg.Connection[Any], schema: str, message: Parked) -> bool:
    """Whether a parked message must wait for another of its table: a truncate for any earlier
    parked message of its table, any other message for an earlier parked truncate of its table."""
    if message.barrier is not None:
        query = ("SELECT EXISTS (SELECT 1 FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
                 " AND (commit_lsn, commit_idx) < (%s, %s) AND starts_with(group_id, %s))")
        params: tuple[Any, ...] = (message.sink, message.commit_lsn, message.commit_idx, message.barrier)
    else:
        query = ("SELECT EXISTS (SELECT 1 FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
                 " AND barrier IS NOT NULL AND (commit_lsn, commit_idx) < (%s, %s) AND starts_with(%s, barrier))")
        params = (message.sink, message.commit_lsn, message.commit_idx, message.group_id)
    row = conn.execute(sql.SQL(query).format(ident(schema)), params).fetchone()
    conn.commit()
    return bool(row and row[0])


def due_groups(conn: psycopg.Connection[Any], schema: str, sink: str, limit: int = 10_000) -> list[str]:
    """Groups of ``sink`` whose first parked message is due for another attempt, oldest first."""
    rows = conn.execute(sql.SQL("""
        SELECT group_id FROM (
            SELECT DISTINCT ON (group_id) group_id, commit_lsn, commit_idx, next_attempt_at
            FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'
            ORDER BY group_id, commit_lsn, commit_idx) heads
        WHERE next_attempt_at <= now() ORDER BY commit_lsn, commit_idx LIMIT %s""").format(ident(schema)),
        (sink, limit)).fetchall()
    conn.commit()
    return [r[0] for r in rows]


def group_messages(conn: psycopg.Connection[Any], schema: str, sink: str, group: str) -> list[Parked]:
    """A group's parked messages in position order."""
    rows = conn.execute(sql.SQL(f"SELECT {COLUMNS} FROM {{}}.buffered_messages WHERE sink = %s AND group_id = %s"
                                " AND state = 'parked' ORDER BY commit_lsn, commit_idx").format(ident(schema)),
                        (sink, group)).fetchall()
    conn.commit()
    return [Parked(*r) for r in rows]


def remove(conn: psycopg.Connection[Any], schema: str, message: Parked) -> None:
    """Forget a message that has now been delivered."""
    with conn.transaction():
        conn.execute(sql.SQL("DELETE FROM {}.buffered_messages WHERE sink = %s AND commit_lsn = %s AND commit_idx = %s")
                     .format(ident(schema)), (message.sink, message.commit_lsn, message.commit_idx))


def record_failure(conn: psycopg.Connection[Any], schema: str, message: Parked, error: str, discard: bool,
                   delay: float) -> None:
    """Count a failed attempt: due again after ``delay`` seconds, or discarded (kept, with its error)."""
    with conn.transaction():
        conn.execute(sql.SQL(
            "UPDATE {}.buffered_messages SET attempts = attempts + 1, last_error = %s, updated_at = now(),"
            " state = CASE WHEN %s THEN 'discarded' ELSE state END,"
            " next_attempt_at = now() + %s * interval '1 second'"
            " WHERE sink = %s AND commit_lsn = %s AND commit_idx = %s").format(ident(schema)),
            (error[:4000], discard, delay, message.sink, message.commit_lsn, message.commit_idx))


def list_messages(conn: psycopg.Connection[Any], schema: str, sink: str | None = None,
                  state: str | None = None) -> list[Parked]:
    """Buffered messages (parked and discarded), by sink and position."""
    where = [sql.SQL("true")]
    params: list[Any] = []
    if sink:
        where.append(sql.SQL("sink = %s"))
        params.append(sink)
    if state:
        where.append(sql.SQL("state = %s"))
        params.append(state)
    rows = conn.execute(sql.SQL("SELECT " + COLUMNS + " FROM {} WHERE {} ORDER BY sink, commit_lsn, commit_idx").format(
        sql.SQL("{}.buffered_messages").format(ident(schema)), sql.SQL(" AND ").join(where)), params).fetchall()
    return [Parked(*r) for r in rows]


def buffer_counts(conn: psycopg.Connection[Any], schema: str) -> dict[str, dict[str, int]]:
    """{sink: {"parked": n, "discarded": n}}."""
    out: dict[str, dict[str, int]] = {}
    for sink, state, n in conn.execute(sql.SQL("SELECT sink, state, count(*) FROM {}.buffered_messages"
                                               " GROUP BY sink, state").format(ident(schema))).fetchall():
        out.setdefault(sink, {"parked": 0, "discarded": 0})[state] = int(n)
    return out


def set_state(conn: psycopg.Connection[Any], schema: str, sink: str, to_state: str, group: str | None = None) -> int:
    """``discarded``: give up a sink's (or one group's) parked messages, kept for the record.
    ``parked``: requeue discarded ones, due now with their attempts reset."""
    from_state = "parked" if to_state == "discarded" else "discarded"
    with conn.transaction():
        cur = conn.execute(sql.SQL(
            "UPDATE {}.buffered_messages SET state = %s, updated_at = now(),"
            " attempts = CASE WHEN %s = 'parked' THEN 0 ELSE attempts END,"
            " next_attempt_at = CASE WHEN %s = 'parked' THEN now() ELSE next_attempt_at END,"
            " last_error = CASE WHEN %s = 'discarded' THEN coalesce(last_error, '') || ' (discarded by hand)'"
            " ELSE last_error END"
            " WHERE sink = %s AND state = %s AND (%s::text IS NULL OR group_id = %s)").format(ident(schema)),
            (to_state, to_state, to_state, to_state, sink, from_state, group, group))
    return cur.rowcount


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
        return (f"{self.sink}: delivered {self.delivered}, filtered {self.filtered}, failed again {self.failed},"
                f" discarded {self.discarded}, still parked {self.still_parked}")


def retry_sink(config: SequinConfig, sink: SinkConfig, deliver: Deliver,
               render: Render | None = None, workers: int = 8) -> RetryReport:
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
        for message in group_messages(conn, schema, sink.name, group):
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
                remove(conn, schema, message)
                log.info("sink %s: parked change %s:%s dropped, the sink's filter no longer takes it", sink.name,
                         message.commit_lsn, message.commit_idx)
                with lock:
                    report.filtered += 1
                continue
            except Exception as exc:  # noqa: BLE001 - DeliveryError, FilterFailed, a transform's error
                attempts = message.attempts + 1
                give_up = sink.max_retry_count is not None and attempts >= sink.max_retry_count
                record_failure(conn, schema, message, str(exc) if isinstance(exc, (DeliveryError, FilterFailed))
                               else f"{type(exc).__name__}: {exc}", give_up, backoff_seconds(attempts))
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
            remove(conn, schema, message)
            with lock:
                report.delivered += 1

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as guard:
        got = guard.execute("SELECT pg_try_advisory_lock(hashtext('sequin-retry:' || %s || ':' || %s))",
                            (schema, sink.name)).fetchone()
        if not got or not got[0]:
            report.skipped = "another retry of this sink is running"
            return report
        try:
            groups = due_groups(guard, schema, sink.name)
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
                    groups = [g for g in due_groups(guard, schema, sink.name) if g in held] if held and progressed else []
            counted = guard.execute(sql.SQL("SELECT count(*) FROM {}.buffered_messages WHERE sink = %s"
                                            " AND state = 'parked'").format(ident(schema)), (sink.name,)).fetchone()
            report.still_parked = int(counted[0]) if counted else 0
        finally:
            guard.execute("SELECT pg_advisory_unlock(hashtext('sequin-retry:' || %s || ':' || %s))",
                          (schema, sink.name))
            for conn in connections:
                conn.close()
    return report
