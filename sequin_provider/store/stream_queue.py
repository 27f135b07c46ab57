"""The pull API's consumer-group queue on the stream table (DESIGN §9, reference/002): claiming a
receive's messages from the stream's head (``FOR UPDATE SKIP LOCKED``), the sink's pending counter
(``stream_pending``) and its recount, settling deliveries (ack: delete them and write the acked
ledger; nack; release), and a sink's counts. How much a receive reads and claims (the head's size,
``max_ack_pending``) and the ack ids are ``sequin_provider.stream_queue``'s."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from sequin_provider.store.connection import durable_commit, ident
from sequin_provider.store.stream import READS_RELEASED

Deliveries = tuple[list[int], list[int], list[int]]
"""Deliveries to settle, as three parallel lists: their messages' commit LSNs, commit indexes and
delivery nonces (what an ack id carries: ``stream_queue.parse_ack_id``)."""

Claimed = tuple[int, int, int, str]
"""A claimed message: (commit_lsn, commit_idx, ack nonce, data JSON)."""

_RECEIVE = """
    WITH head AS (
        SELECT m.ctid AS row_id, m.commit_lsn, m.commit_idx, m.group_id, m.barrier, {ready} AS ready
        FROM {s}.stream_messages m
        WHERE m.sink = %(sink)s AND m.commit_lsn <= %(visible)s
        ORDER BY m.commit_lsn, m.commit_idx LIMIT %(head)s),
    barriers AS MATERIALIZED (
        SELECT commit_lsn, commit_idx, barrier FROM head WHERE barrier IS NOT NULL),
    firsts AS (
        SELECT DISTINCT ON (group_id COLLATE "C") row_id, commit_lsn, commit_idx, group_id, barrier, ready
        FROM head ORDER BY group_id COLLATE "C", commit_lsn, commit_idx),
    deliverable AS (
        SELECT row_id FROM firsts f WHERE ready
        AND (f.barrier IS NULL OR NOT EXISTS (SELECT 1 FROM head h WHERE (h.commit_lsn, h.commit_idx) <
             (f.commit_lsn, f.commit_idx) AND starts_with(h.group_id COLLATE "C", f.barrier)))
        AND NOT EXISTS (SELECT 1 FROM barriers b WHERE (b.commit_lsn, b.commit_idx) < (f.commit_lsn, f.commit_idx)
             AND starts_with(f.group_id COLLATE "C", b.barrier))),
    picked AS (
        SELECT m.commit_lsn, m.commit_idx, m.state = 'available' AS newly_pending
        FROM {s}.stream_messages m
        WHERE m.ctid = ANY(ARRAY(SELECT row_id FROM deliverable)) AND {ready}
        ORDER BY m.commit_lsn, m.commit_idx
        LIMIT %(limit)s
        FOR UPDATE OF m SKIP LOCKED),
    claimed AS (
        UPDATE {s}.stream_messages t
           SET ack_nonce = floor(random() * %(nonces)s)::integer, state = 'delivered',
               deliver_count = t.deliver_count + 1,
               not_visible_until = clock_timestamp() + %(timeout)s * interval '1 second',
               last_delivered_at = now()
          FROM picked
         WHERE t.sink = %(sink)s AND t.commit_lsn = picked.commit_lsn AND t.commit_idx = picked.commit_idx
        RETURNING t.commit_lsn, t.commit_idx, t.ack_nonce, t.data::text, picked.newly_pending),
    counted AS (
        INSERT INTO {s}.stream_pending AS p (sink, pending)
        SELECT %(sink)s, count(*) FROM claimed WHERE newly_pending HAVING count(*) > 0
        ON CONFLICT (sink) DO UPDATE SET pending = p.pending + EXCLUDED.pending)
    SELECT c.commit_lsn, c.commit_idx, c.ack_nonce, c.data, h.n
    FROM (SELECT count(*) AS n FROM head) h LEFT JOIN claimed c ON true"""


def receive_start(conn: psycopg.Connection[Any], schema: str, sink: str) -> tuple[int, int] | None:
    """(visible LSN, pending count) of ``sink`` as a receive starts, in the caller's transaction;
    None while none of its messages is visible (no visibility watermark yet)."""
    row = conn.execute(
        sql.SQL(
            "SELECT (SELECT visible_lsn FROM {0}.stream_visibility WHERE sink = %(sink)s),"
            " (SELECT pending FROM {0}.stream_pending WHERE sink = %(sink)s)"
        ).format(ident(schema)),
        {"sink": sink},
    ).fetchone()
    if row is None or row[0] is None:
        return None
    return int(row[0]), int(row[1] or 0)


def recount_pending(conn: psycopg.Connection[Any], schema: str, sink: str, counted: int, every: float) -> int:
    """The exact pending count of ``sink``, written back to its counter; ``counted`` when the last
    recount is under ``every`` seconds old. Exact because the counter row stays locked while
    counting: a receive, ack or nack changes its rows and the counter in one transaction."""
    row = conn.execute(
        sql.SQL(
            "UPDATE {0}.stream_pending SET pending = (SELECT count(*) FROM {0}.stream_messages"
            " WHERE sink = %(sink)s AND state = 'delivered'), checked_at = now()"
            " WHERE sink = %(sink)s AND checked_at < now() - %(every)s * interval '1 second'"
            " RETURNING pending"
        ).format(ident(schema)),
        {"sink": sink, "every": every},
    ).fetchone()
    return int(row[0]) if row else counted


def claim_from_head(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str,
    visible: int,
    head: int,
    only_redeliveries: bool,
    limit: int,
    visibility_timeout: float,
    nonces: int,
) -> tuple[list[Claimed], int]:
    """Claim up to ``limit`` deliverable messages among the first ``head`` of ``sink`` at or below
    commit LSN ``visible``, for ``visibility_timeout`` seconds, in the caller's transaction; returns
    them and how many messages the head held (fewer than ``head``: it held every visible one).

    Deliverable: its group's first in the head, visible (not received, or its visibility timed
    out; not a backfill read whose window is open), with ``only_redeliveries`` received before, and
    not on the wrong side of a truncate of its table (its ``barrier``). Rows are claimed with
    ``FOR UPDATE SKIP LOCKED`` (concurrent receivers never get the same message, nor wait for one
    another), each with a new random nonce below ``nonces``, and the newly pending ones are added
    to the sink's pending counter in the same statement."""
    s = ident(schema)
    ready = sql.SQL(
        "(m.not_visible_until IS NULL OR m.not_visible_until <= now())"
        " AND (NOT %(only_redeliveries)s OR m.deliver_count > 0) AND {}"
    ).format(sql.SQL(READS_RELEASED).format(s=s))
    rows = conn.execute(
        sql.SQL(_RECEIVE).format(s=s, ready=ready),
        {
            "sink": sink,
            "visible": visible,
            "head": head,
            "only_redeliveries": only_redeliveries,
            "limit": limit,
            "timeout": visibility_timeout,
            "nonces": nonces,
        },
    ).fetchall()
    return [r[:4] for r in rows if r[0] is not None], rows[0][4]


def _settle(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str,
    deliveries: Deliveries,
    change: sql.Composable,
    then: sql.Composable | None = None,
    durable: bool = False,
) -> int:
    """Apply ``change`` (a DELETE or UPDATE of the messages matched by ``a``, returning their
    positions) to the pending messages of ``deliveries``, and take them off the sink's pending
    counter in the same transaction; ``then`` adds CTEs on ``settled``; ``durable``: the commit is
    durable when it returns, whatever the server's ``synchronous_commit``."""
    lsns, idxs, nonces = deliveries
    s = ident(schema)
    with conn.transaction():
        if durable:
            durable_commit(conn)
        row = conn.execute(
            sql.SQL("""
            WITH settled AS ({change}),{then}
            n AS (SELECT count(*) AS n FROM settled),
            counted AS (UPDATE {s}.stream_pending p SET pending = greatest(p.pending - n.n, 0)
                          FROM n WHERE p.sink = %(sink)s AND n.n > 0)
            SELECT n FROM n""").format(change=change, then=then or sql.SQL(""), s=s),
            {"sink": sink, "lsns": lsns, "idxs": idxs, "nonces": nonces},
        ).fetchone()
    return int(row[0]) if row else 0


_MATCH = sql.SQL(
    " unnest(%(lsns)s::bigint[], %(idxs)s::integer[], %(nonces)s::integer[]) a(lsn, idx, nonce)"
    " WHERE m.sink = %(sink)s AND m.commit_lsn = a.lsn AND m.commit_idx = a.idx AND m.ack_nonce = a.nonce"
    " AND m.state = 'delivered' RETURNING m.commit_lsn, m.commit_idx"
)

_LEDGER = """
            ledger AS (INSERT INTO {s}.stream_acked (sink, min_lsn, max_lsn, lsns, idxs)
                SELECT %(sink)s, min(commit_lsn), max(commit_lsn), array_agg(commit_lsn ORDER BY commit_lsn, commit_idx),
                       array_agg(commit_idx ORDER BY commit_lsn, commit_idx)
                FROM settled
                WHERE commit_lsn >= coalesce((SELECT passed_lsn FROM {s}.stream_visibility WHERE sink = %(sink)s), 0)
                HAVING count(*) > 0),"""
"""The ack's one entry in the acked ledger: the positions it settled that the slot has not passed
yet (a replay of their batch must not write them again: ``insert_stream_copy``)."""


def ack_messages(conn: psycopg.Connection[Any], schema: str, sink: str, deliveries: Deliveries) -> int:
    """Delete the pending messages of ``deliveries`` (others are ignored) and return how many.

    Their positions stay in the acked ledger until the slot has passed them (``prune_acked``), so
    a micro-batch replayed after a crash of the stream app skips them; and the ack is durable when
    it returns (a crash of the store does not undo an ack its consumer was told of)."""
    s = ident(schema)
    return _settle(
        conn,
        schema,
        sink,
        deliveries,
        sql.SQL("DELETE FROM {}.stream_messages m USING").format(s) + _MATCH,
        sql.SQL(_LEDGER).format(s=s),
        durable=True,
    )


def nack_messages(conn: psycopg.Connection[Any], schema: str, sink: str, deliveries: Deliveries) -> int:
    """Make the pending messages of ``deliveries`` visible again at once (their ack nonces cleared)."""
    return _settle(
        conn,
        schema,
        sink,
        deliveries,
        sql.SQL(
            "UPDATE {}.stream_messages m SET ack_nonce = NULL, state = 'available', not_visible_until = NULL FROM"
        ).format(ident(schema))
        + _MATCH,
    )


def release_messages(conn: psycopg.Connection[Any], schema: str, sink: str, deliveries: Deliveries) -> int:
    """A nack of ``deliveries`` that also takes back their delivery count (nobody received them);
    a message claimed again since, with another nonce, is left alone."""
    return _settle(
        conn,
        schema,
        sink,
        deliveries,
        sql.SQL(
            "UPDATE {}.stream_messages m SET ack_nonce = NULL, state = 'available', not_visible_until = NULL,"
            " deliver_count = greatest(m.deliver_count - 1, 0) FROM"
        ).format(ident(schema))
        + _MATCH,
    )


def stream_counts(conn: psycopg.Connection[Any], schema: str, sink: str) -> dict[str, int]:
    """Messages of a sink: total, visible, outstanding (received and not yet acked)."""
    row = conn.execute(
        sql.SQL(
            "SELECT count(*), count(*) FILTER (WHERE commit_lsn <= coalesce((SELECT visible_lsn FROM {0}.stream_visibility"
            " WHERE sink = %s), -1)), count(*) FILTER (WHERE not_visible_until > now())"
            " FROM {0}.stream_messages WHERE sink = %s"
        ).format(ident(schema)),
        (sink, sink),
    ).fetchone()
    total, visible, outstanding = row if row else (0, 0, 0)
    return {"total": int(total), "visible": int(visible), "outstanding": int(outstanding)}


def pending_counts(conn: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """Every sink's pending counter (received, neither acked nor nacked; ``stream_pending``): one
    small table read, no count over the stream table (``metrics.api``)."""
    return {
        sink: int(pending)
        for sink, pending in conn.execute(
            sql.SQL("SELECT sink, pending FROM {}.stream_pending").format(ident(schema))
        ).fetchall()
    }
