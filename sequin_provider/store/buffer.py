"""The buffer of parked messages (``buffered_messages``, DESIGN §2.4, §9): parking, the parked
groups, heads and barriers a batch must wait behind, the due groups and their messages, recording
an attempt, and listing, counting, discarding and requeueing. The retry policy (backoff, when to
give up, delivery) is ``sequin_provider.buffer``'s."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Sequence

import psycopg
from psycopg import sql

from sequin_provider.store.connection import ident


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


PARKED_COLUMNS = (
    "sink, commit_lsn, commit_idx, group_id, idempotency_key, data, source, state, attempts,"
    " next_attempt_at, last_error, barrier"
)
"""The columns of ``buffered_messages`` read into a ``Parked``, in its field order."""


def park_messages(conn: psycopg.Connection[Any], schema: str, rows: Sequence[ParkRow]) -> int:
    """Durably park messages (a replayed batch parks nothing twice); returns how many are new."""
    if not rows:
        return 0
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(
            sql.SQL(
                "INSERT INTO {}.buffered_messages (sink, commit_lsn, commit_idx, group_id, idempotency_key, data, source,"
                " attempts, last_error, next_attempt_at, barrier)"
                " SELECT sink, lsn, idx, grp, key, data, source, attempts, err, now() + delay * interval '1 second', barrier"
                " FROM unnest(%s::text[], %s::bigint[], %s::int[], %s::text[], %s::text[], %s::text[], %s::text[],"
                " %s::int[], %s::text[], %s::float8[], %s::text[])"
                " AS r(sink, lsn, idx, grp, key, data, source, attempts, err, delay, barrier)"
                " ON CONFLICT DO NOTHING"
            ).format(ident(schema)),
            (
                [r.sink for r in rows],
                [r.commit_lsn for r in rows],
                [r.commit_idx for r in rows],
                [r.group_id for r in rows],
                [r.idempotency_key for r in rows],
                [r.data for r in rows],
                [r.source for r in rows],
                [r.attempts for r in rows],
                [r.error[:4000] for r in rows],
                [r.delay for r in rows],
                [r.barrier for r in rows],
            ),
        )
        return cur.rowcount


def parked_heads(
    conn: psycopg.Connection[Any], schema: str, sink: str, groups: Iterable[str]
) -> dict[str, tuple[int, int]]:
    """For each of ``groups`` with parked messages in ``sink``, the position of its first one: a
    message of the group after it waits behind it; one before it (earlier in a batch whose later
    change was parked first) does not.

    Asked on every push of every batch, usually with thousands of groups and nothing parked: the
    sink's parked groups are read first (at most one more than asked about), and only when there
    are more of them than that are the groups sent to the store to match."""
    wanted = set(groups)
    if not wanted:
        return {}
    parked = conn.execute(
        sql.SQL(
            "SELECT DISTINCT group_id FROM {}.buffered_messages WHERE sink = %s AND state = 'parked' LIMIT %s"
        ).format(ident(schema)),
        (sink, len(wanted) + 1),
    ).fetchall()
    asked = list(wanted) if len(parked) > len(wanted) else [g for (g,) in parked if g in wanted]
    rows = (
        conn.execute(
            sql.SQL(
                "SELECT DISTINCT ON (group_id) group_id, commit_lsn, commit_idx"
                " FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
                " AND group_id = ANY(%s) ORDER BY group_id, commit_lsn, commit_idx"
            ).format(ident(schema)),
            (sink, asked),
        ).fetchall()
        if asked
        else []
    )
    conn.commit()
    return {g: (int(lsn), int(idx)) for g, lsn, idx in rows}


def sinks_with_parked(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str]) -> set[str]:
    """Which of ``sinks`` have parked messages (one indexed probe per sink, in one round trip)."""
    if not sinks:
        return set()
    rows = conn.execute(
        sql.SQL(
            "SELECT s FROM unnest(%s::text[]) s WHERE EXISTS (SELECT 1 FROM"
            " {}.buffered_messages b WHERE b.sink = s AND b.state = 'parked')"
        ).format(ident(schema)),
        (list(sinks),),
    ).fetchall()
    conn.commit()
    return {r[0] for r in rows}


def parked_barriers(
    conn: psycopg.Connection[Any], schema: str, sink: str, prefixes: Iterable[str] = ()
) -> tuple[set[str], set[str]]:
    """The barriers of ``sink``'s parked truncates (every later message of their tables must be
    parked behind them), and which of ``prefixes`` (the barriers of a batch's truncates) have any
    parked message (such a truncate must be parked behind it). Asked on every push: the first is
    one look at a partial index that holds only parked truncates."""
    barred = {
        r[0]
        for r in conn.execute(
            sql.SQL(
                "SELECT DISTINCT barrier FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
                " AND barrier IS NOT NULL"
            ).format(ident(schema)),
            (sink,),
        ).fetchall()
    }
    held: set[str] = set()
    wanted = sorted(set(prefixes))
    if wanted:
        held = {
            r[0]
            for r in conn.execute(
                sql.SQL(
                    "SELECT p FROM unnest(%s::text[]) p WHERE EXISTS (SELECT 1 FROM {}.buffered_messages b"
                    " WHERE b.sink = %s AND b.state = 'parked' AND starts_with(b.group_id, p))"
                ).format(ident(schema)),
                (wanted, sink),
            ).fetchall()
        }
    conn.commit()
    return barred, held


def behind_barrier(conn: psycopg.Connection[Any], schema: str, message: Parked) -> bool:
    """Whether a parked message must wait for another of its table: a truncate for any earlier
    parked message of its table, any other message for an earlier parked truncate of its table."""
    if message.barrier is not None:
        query = (
            "SELECT EXISTS (SELECT 1 FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
            " AND (commit_lsn, commit_idx) < (%s, %s) AND starts_with(group_id, %s))"
        )
        params: tuple[Any, ...] = (message.sink, message.commit_lsn, message.commit_idx, message.barrier)
    else:
        query = (
            "SELECT EXISTS (SELECT 1 FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'"
            " AND barrier IS NOT NULL AND (commit_lsn, commit_idx) < (%s, %s) AND starts_with(%s, barrier))"
        )
        params = (message.sink, message.commit_lsn, message.commit_idx, message.group_id)
    row = conn.execute(sql.SQL(query).format(ident(schema)), params).fetchone()
    conn.commit()
    return bool(row and row[0])


def due_parked_groups(conn: psycopg.Connection[Any], schema: str, sink: str, limit: int = 10_000) -> list[str]:
    """Groups of ``sink`` whose first parked message is due for another attempt, oldest first."""
    rows = conn.execute(
        sql.SQL("""
        SELECT group_id FROM (
            SELECT DISTINCT ON (group_id) group_id, commit_lsn, commit_idx, next_attempt_at
            FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'
            ORDER BY group_id, commit_lsn, commit_idx) heads
        WHERE next_attempt_at <= now() ORDER BY commit_lsn, commit_idx LIMIT %s""").format(ident(schema)),
        (sink, limit),
    ).fetchall()
    conn.commit()
    return [r[0] for r in rows]


def parked_group_messages(conn: psycopg.Connection[Any], schema: str, sink: str, group: str) -> list[Parked]:
    """A group's parked messages in position order."""
    rows = conn.execute(
        sql.SQL(
            f"SELECT {PARKED_COLUMNS} FROM {{}}.buffered_messages WHERE sink = %s"
            " AND group_id = %s AND state = 'parked' ORDER BY commit_lsn, commit_idx"
        ).format(ident(schema)),
        (sink, group),
    ).fetchall()
    conn.commit()
    return [Parked(*r) for r in rows]


def count_parked(conn: psycopg.Connection[Any], schema: str, sink: str) -> int:
    """How many messages of ``sink`` are parked (discarded ones not counted)."""
    counted = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.buffered_messages WHERE sink = %s AND state = 'parked'").format(ident(schema)),
        (sink,),
    ).fetchone()
    return int(counted[0]) if counted else 0


def remove_parked(conn: psycopg.Connection[Any], schema: str, message: Parked) -> None:
    """Forget a message that has now been delivered (or that the sink's filter no longer takes)."""
    with conn.transaction():
        conn.execute(
            sql.SQL("DELETE FROM {}.buffered_messages WHERE sink = %s AND commit_lsn = %s AND commit_idx = %s").format(
                ident(schema)
            ),
            (message.sink, message.commit_lsn, message.commit_idx),
        )


def record_parked_failure(
    conn: psycopg.Connection[Any], schema: str, message: Parked, error: str, discard: bool, delay: float
) -> None:
    """Count a failed attempt: due again after ``delay`` seconds, or discarded (kept, with its error)."""
    with conn.transaction():
        conn.execute(
            sql.SQL(
                "UPDATE {}.buffered_messages SET attempts = attempts + 1, last_error = %s, updated_at = now(),"
                " state = CASE WHEN %s THEN 'discarded' ELSE state END,"
                " next_attempt_at = now() + %s * interval '1 second'"
                " WHERE sink = %s AND commit_lsn = %s AND commit_idx = %s"
            ).format(ident(schema)),
            (error[:4000], discard, delay, message.sink, message.commit_lsn, message.commit_idx),
        )


def list_buffered(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str | None = None,
    state: str | None = None,
    limit: int | None = None,
) -> list[Parked]:
    """Buffered messages (parked and discarded), by sink and position (the first ``limit``)."""
    where = [sql.SQL("true")]
    params: list[Any] = []
    if sink:
        where.append(sql.SQL("sink = %s"))
        params.append(sink)
    if state:
        where.append(sql.SQL("state = %s"))
        params.append(state)
    query = "SELECT " + PARKED_COLUMNS + " FROM {} WHERE {} ORDER BY sink, commit_lsn, commit_idx LIMIT %s"
    rows = conn.execute(
        sql.SQL(query).format(sql.SQL("{}.buffered_messages").format(ident(schema)), sql.SQL(" AND ").join(where)),
        [*params, limit],
    ).fetchall()
    return [Parked(*r) for r in rows]


def buffer_counts(conn: psycopg.Connection[Any], schema: str) -> dict[str, dict[str, int]]:
    """{sink: {"parked": n, "discarded": n}}."""
    out: dict[str, dict[str, int]] = {}
    for sink, state, n in conn.execute(
        sql.SQL("SELECT sink, state, count(*) FROM {}.buffered_messages GROUP BY sink, state").format(ident(schema))
    ).fetchall():
        out.setdefault(sink, {"parked": 0, "discarded": 0})[state] = int(n)
    return out


def set_buffered_state(
    conn: psycopg.Connection[Any], schema: str, sink: str, to_state: str, group: str | None = None
) -> int:
    """``discarded``: give up a sink's (or one group's) parked messages, kept for the record.
    ``parked``: requeue discarded ones, due now with their attempts reset. Returns how many changed."""
    from_state = "parked" if to_state == "discarded" else "discarded"
    with conn.transaction():
        cur = conn.execute(
            sql.SQL(
                "UPDATE {}.buffered_messages SET state = %s, updated_at = now(),"
                " attempts = CASE WHEN %s = 'parked' THEN 0 ELSE attempts END,"
                " next_attempt_at = CASE WHEN %s = 'parked' THEN now() ELSE next_attempt_at END,"
                " last_error = CASE WHEN %s = 'discarded' THEN coalesce(last_error, '') || ' (discarded by hand)'"
                " ELSE last_error END"
                " WHERE sink = %s AND state = %s AND (%s::text IS NULL OR group_id = %s)"
            ).format(ident(schema)),
            (to_state, to_state, to_state, to_state, sink, from_state, group, group),
        )
    return cur.rowcount


def make_parked_due(conn: psycopg.Connection[Any], schema: str, sink: str, group: str | None = None) -> int:
    """Make a sink's (or one group's) parked messages due for their next attempt now (a retry by hand
    does not wait for the backoff); their attempts are kept. Returns how many."""
    with conn.transaction():
        cur = conn.execute(
            sql.SQL(
                "UPDATE {}.buffered_messages SET next_attempt_at = now(), updated_at = now()"
                " WHERE sink = %s AND state = 'parked' AND next_attempt_at > now()"
                " AND (%s::text IS NULL OR group_id = %s)"
            ).format(ident(schema)),
            (sink, group, group),
        )
    return cur.rowcount
