"""The pull API's consumer-group queue on the stream table (DESIGN §9, reference/002): claiming a
receive's messages from the stream's head (``FOR UPDATE SKIP LOCKED``), the sink's pending counter
(``stream_pending``) and its recount, settling deliveries (ack: delete them and write the acked
ledger; nack; release), and a sink's counts. How much a receive reads and claims (the head's size,
``max_ack_pending``) and the ack ids are ``sequin_provider.stream_queue``'s."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import psycopg
from psycopg import sql

from sequin_provider.store.connection import DURABLE_COMMIT, ident, int_array, own_transaction
from sequin_provider.store.stream import READ_DATA, READS_RELEASED, TEMPLATE_JOIN

Deliveries = tuple[list[int], list[int], list[int]]
"""Deliveries to settle, as three parallel lists: their messages' commit LSNs, commit indexes and
delivery nonces (what an ack id carries: ``ack_ids.parse_ack_id``)."""

Claimed = tuple[int, int, int, str]
"""A claimed message: (commit_lsn, commit_idx, ack nonce, data JSON)."""

# ``claimed`` updates the rows ``picked`` locked by their ctid, one heap fetch each where a join on
# the primary key descended its index per row (about a tenth of the store's CPU per receive). A row
# the lock found changed after the statement's snapshot (made available again by a nack) is locked
# in its newest version, whose ctid that snapshot cannot see: it is left unclaimed, available to the
# next receive, never claimed twice.
_RECEIVE = """
    WITH {start}head AS (
        SELECT m.ctid AS row_id, m.commit_lsn, m.commit_idx, m.group_id, m.barrier, {ready} AS ready
        FROM {s}.stream_messages m
        WHERE m.sink = %(sink)s AND m.commit_lsn <= {visible}
        ORDER BY m.commit_lsn, m.commit_idx LIMIT {head}),
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
        SELECT m.ctid AS row_id, m.commit_lsn, m.commit_idx, m.template, m.state = 'available' AS newly_pending
        FROM {s}.stream_messages m
        WHERE m.ctid = ANY(ARRAY(SELECT row_id FROM deliverable)) AND {ready}
        ORDER BY m.commit_lsn, m.commit_idx
        LIMIT {limit}
        FOR UPDATE OF m SKIP LOCKED),
    claimed AS (
        UPDATE {s}.stream_messages t
           SET ack_nonce = floor(random() * %(nonces)s)::integer, state = 'delivered',
               deliver_count = t.deliver_count + 1,
               not_visible_until = clock_timestamp() + %(timeout)s * interval '1 second',
               last_delivered_at = now()
          FROM picked {template_join}
         WHERE t.ctid = picked.row_id AND t.sink = %(sink)s
        RETURNING t.commit_lsn, t.commit_idx, t.ack_nonce, {data} AS data, picked.newly_pending),
    counted AS (
        INSERT INTO {s}.stream_pending AS p (sink, pending)
        SELECT %(sink)s, count(*) FROM claimed WHERE newly_pending HAVING count(*) > 0
        ON CONFLICT (sink) DO UPDATE SET pending = p.pending + EXCLUDED.pending)
    SELECT c.commit_lsn, c.commit_idx, c.ack_nonce, c.data, h.n{started}
    FROM {start_row}(SELECT count(*) AS n FROM head) h LEFT JOIN claimed c ON true"""

_START = """start AS (
        SELECT v.visible_lsn AS visible, p.pending, l.claim,
               CASE WHEN l.claim > 0 THEN p.pending + %(growth)s * l.claim ELSE 0 END AS head
        FROM {s}.stream_visibility v
        CROSS JOIN (SELECT greatest(coalesce((SELECT pending FROM {s}.stream_pending
                                              WHERE sink = %(sink)s), 0), 0) AS pending OFFSET 0) p
        CROSS JOIN LATERAL (SELECT CASE WHEN p.pending < %(max_pending)s
                                   THEN least(%(batch)s, %(max_pending)s - p.pending) ELSE 0 END AS claim) l
        WHERE v.sink = %(sink)s AND v.visible_lsn IS NOT NULL),
    """
"""A receive's start in its first statement (``claim_first``): the sink's visibility watermark and
pending counter, how many it may claim (none when ``max_pending`` are pending) and the head to
read for them (the pending ones and ``growth`` times the claim)."""


def _ready(s: sql.Composable) -> sql.Composable:
    """Whether message ``m`` may be handed out now (the claim's ``only_redeliveries`` parameter)."""
    return sql.SQL(
        "(m.not_visible_until IS NULL OR m.not_visible_until <= now())"
        " AND (NOT %(only_redeliveries)s OR m.deliver_count > 0) AND {}"
    ).format(sql.SQL(READS_RELEASED).format(s=s))


@lru_cache(maxsize=None)
def _receive_sql(schema: str, first: bool, encoding: str) -> bytes:
    """The claim statement of ``schema`` as a connection of ``encoding`` sends it (composed once:
    composing it and rendering it to bytes took 65 µs of a receive's 300 µs in the API):
    ``first`` reads the receive's start in the same statement (``_START``), else the caller
    passes the visibility watermark, the head and the claim."""
    s = ident(schema)
    data = sql.SQL(READ_DATA).format(m=sql.Identifier("t"), s=s, t=sql.Identifier("tpl"))
    template_join = sql.SQL(TEMPLATE_JOIN).format(s=s, t=sql.Identifier("tpl"), template=sql.SQL("picked.template"))
    if first:
        composed = sql.SQL(_RECEIVE).format(
            s=s,
            ready=_ready(s),
            data=data,
            template_join=template_join,
            start=sql.SQL(_START).format(s=s),
            visible=sql.SQL("(SELECT visible FROM start)"),
            head=sql.SQL("coalesce((SELECT head FROM start), 0)"),
            limit=sql.SQL("(SELECT claim FROM start)"),
            started=sql.SQL(", s.visible, s.pending, s.claim, s.head"),
            start_row=sql.SQL("start s CROSS JOIN "),
        )
    else:
        composed = sql.SQL(_RECEIVE).format(
            s=s,
            ready=_ready(s),
            data=data,
            template_join=template_join,
            start=sql.SQL(""),
            visible=sql.SQL("%(visible)s"),
            head=sql.SQL("%(head)s"),
            limit=sql.SQL("%(limit)s"),
            started=sql.SQL(""),
            start_row=sql.SQL(""),
        )
    return composed.as_string(None).encode(encoding)


@dataclass(frozen=True)
class FirstClaim:
    """What a receive's first statement claimed and read (``claim_first``)."""

    claimed: list[Claimed]
    in_head: int
    """How many messages the head held (fewer than ``head``: every visible one)."""
    visible: int
    """The sink's visibility watermark."""
    pending: int
    """The sink's pending counter before this claim."""
    claim: int
    """How many it could claim: the batch, fewer near ``max_pending``, none at it."""
    head: int
    """How many messages of the head it read at most."""


def claim_first(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str,
    batch_size: int,
    max_pending: int,
    growth: int,
    visibility_timeout: float,
    nonces: int,
) -> FirstClaim | None:
    """A receive's first claim, in one statement: the sink's visibility watermark and pending
    counter, and ``claim_from_head`` of new messages (up to ``batch_size``, and at most up to
    ``max_pending`` pending; nothing at it) in a head of the pending messages and ``growth`` times
    the claim. None while none of the sink's messages is visible. On an autocommit connection outside a transaction block the
    statement commits by itself (``own_transaction``): one round trip for a whole receive."""
    with own_transaction(conn):
        rows = conn.execute(
            _receive_sql(schema, True, conn.info.encoding),
            {
                "sink": sink,
                "batch": batch_size,
                "max_pending": max_pending,
                "growth": growth,
                "only_redeliveries": False,
                "timeout": visibility_timeout,
                "nonces": nonces,
            },
        ).fetchall()
    if not rows:
        return None
    _, _, _, _, in_head, visible, pending, claim, head = rows[0]
    return FirstClaim([r[:4] for r in rows if r[0] is not None], in_head, int(visible), int(pending), claim, head)


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
    rows = conn.execute(
        _receive_sql(schema, False, conn.info.encoding),
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


_MATCH = (
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

_SETTLE = """
            WITH settled AS ({change}),{then}
            n AS (SELECT count(*) AS n FROM settled),
            counted AS (UPDATE {s}.stream_pending p SET pending = greatest(p.pending - n.n, 0)
                          FROM n WHERE p.sink = %(sink)s AND n.n > 0)
            SELECT n{durable} FROM n"""

_SETTLEMENTS = {
    "ack": ("DELETE FROM {s}.stream_messages m USING", _LEDGER, True),
    "nack": (
        "UPDATE {s}.stream_messages m SET ack_nonce = NULL, state = 'available', not_visible_until = NULL FROM",
        "",
        False,
    ),
    "release": (
        "UPDATE {s}.stream_messages m SET ack_nonce = NULL, state = 'available', not_visible_until = NULL,"
        " deliver_count = greatest(m.deliver_count - 1, 0) FROM",
        "",
        False,
    ),
}
"""Per settlement: the change to the matched messages (a DELETE or an UPDATE returning their
positions), CTEs on ``settled`` it adds, and whether its commit must be durable when it returns."""


@lru_cache(maxsize=None)
def _settle_sql(schema: str, settlement: str, encoding: str) -> bytes:
    """The one statement of ``settlement`` on ``schema``, as a connection of ``encoding`` sends it:
    its change, then the sink's pending counter taken down by what it settled, and with
    ``durable`` the transaction made durable."""
    change, then, durable = _SETTLEMENTS[settlement]
    s = ident(schema)
    composed = sql.SQL(_SETTLE).format(
        change=sql.SQL(change + _MATCH).format(s=s),
        then=sql.SQL(then).format(s=s),
        s=s,
        durable=sql.SQL(", " + DURABLE_COMMIT if durable else ""),
    )
    return composed.as_string(None).encode(encoding)


def _settle(conn: psycopg.Connection[Any], schema: str, sink: str, deliveries: Deliveries, settlement: str) -> int:
    """Apply ``settlement`` (``_SETTLEMENTS``) to the pending messages of ``deliveries`` in one
    statement, which takes them off the sink's pending counter too; returns how many it settled."""
    lsns, idxs, nonces = deliveries
    with own_transaction(conn):
        row = conn.execute(
            _settle_sql(schema, settlement, conn.info.encoding),
            {"sink": sink, "lsns": int_array(lsns), "idxs": int_array(idxs), "nonces": int_array(nonces)},
        ).fetchone()
    return int(row[0]) if row else 0


def ack_messages(conn: psycopg.Connection[Any], schema: str, sink: str, deliveries: Deliveries) -> int:
    """Delete the pending messages of ``deliveries`` (others are ignored) and return how many.

    Their positions stay in the acked ledger until the slot has passed them (``prune_acked``), so
    a micro-batch replayed after a crash of the stream app skips them; and the ack is durable when
    it returns (a crash of the store does not undo an ack its consumer was told of)."""
    return _settle(conn, schema, sink, deliveries, "ack")


def nack_messages(conn: psycopg.Connection[Any], schema: str, sink: str, deliveries: Deliveries) -> int:
    """Make the pending messages of ``deliveries`` visible again at once (their ack nonces cleared)."""
    return _settle(conn, schema, sink, deliveries, "nack")


def release_messages(conn: psycopg.Connection[Any], schema: str, sink: str, deliveries: Deliveries) -> int:
    """A nack of ``deliveries`` that also takes back their delivery count (nobody received them);
    a message claimed again since, with another nonce, is left alone."""
    return _settle(conn, schema, sink, deliveries, "release")


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
