"""Consumer-group queries on a Sequin Stream sink's messages (DESIGN §9, reference/002).

A consumer group shares one stream. ``receive`` hands out visible messages (at or below the sink's
visibility watermark), at most one per group and never one whose group has an earlier message
still in the table (outstanding, or not yet acked), so a group is processed strictly in order.
Received messages are invisible for the visibility timeout; ``ack`` deletes them, ``nack`` makes
them visible at once. Concurrent receivers never get the same message: rows are claimed with
``FOR UPDATE SKIP LOCKED``. API tokens are stored as SHA-256 hashes only.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

import psycopg
from psycopg import sql

from sequin_provider.store import _ident

TOKEN_PREFIX = "sqn_"


@dataclass(frozen=True)
class Delivery:
    """One received message: the id to ack/nack it with and its JSON text."""

    ack_id: str
    data: str


def receive(conn: psycopg.Connection[Any], schema: str, sink: str, batch_size: int, visibility_timeout: float,
            max_ack_pending: int) -> list[Delivery]:
    """Claim up to ``batch_size`` deliverable messages of ``sink`` for ``visibility_timeout`` seconds.

    When ``max_ack_pending`` messages are pending (received and neither acked nor nacked, including
    those whose visibility timed out), no new messages are handed out, only redeliveries.
    """
    s = _ident(schema)
    with conn.transaction():
        row = conn.execute(sql.SQL("SELECT visible_lsn FROM {}.stream_visibility WHERE sink = %s").format(s),
                           (sink,)).fetchone()
        if row is None:
            return []
        pending = conn.execute(sql.SQL("SELECT count(*) FROM {}.stream_messages WHERE sink = %s"
                                       " AND state = 'delivered'").format(s), (sink,)).fetchone()
        outstanding = int(pending[0]) if pending else 0
        only_redeliveries = outstanding >= max_ack_pending
        limit = batch_size if only_redeliveries else min(batch_size, max_ack_pending - outstanding)
        rows = conn.execute(sql.SQL("""
            WITH picked AS (
                SELECT m.commit_lsn, m.commit_idx FROM {s}.stream_messages m
                WHERE m.sink = %(sink)s AND m.commit_lsn <= %(visible)s
                  AND (m.not_visible_until IS NULL OR m.not_visible_until <= now())
                  AND (NOT %(only_redeliveries)s OR m.deliver_count > 0)
                  AND NOT EXISTS (SELECT 1 FROM {s}.stream_messages e
                                  WHERE e.sink = m.sink AND e.group_id = m.group_id
                                    AND (e.commit_lsn, e.commit_idx) < (m.commit_lsn, m.commit_idx))
                ORDER BY m.commit_lsn, m.commit_idx
                LIMIT %(limit)s
                FOR UPDATE OF m SKIP LOCKED)
            UPDATE {s}.stream_messages t
               SET ack_id = gen_random_uuid(), state = 'delivered', deliver_count = t.deliver_count + 1,
                   not_visible_until = clock_timestamp() + %(timeout)s * interval '1 second',
                   last_delivered_at = now()
              FROM picked
             WHERE t.sink = %(sink)s AND t.commit_lsn = picked.commit_lsn AND t.commit_idx = picked.commit_idx
            RETURNING t.commit_lsn, t.commit_idx, t.ack_id::text, t.data::text""").format(s=s),
            {"sink": sink, "visible": int(row[0]), "only_redeliveries": only_redeliveries, "limit": limit,
             "timeout": visibility_timeout}).fetchall()
    return [Delivery(ack_id, data) for _, _, ack_id, data in sorted(rows)]


def ack(conn: psycopg.Connection[Any], schema: str, sink: str, ack_ids: Sequence[str]) -> int:
    """Delete the messages delivered with ``ack_ids``; unknown or repeated ids are ignored."""
    with conn.transaction():
        cur = conn.execute(sql.SQL("DELETE FROM {}.stream_messages WHERE sink = %s AND ack_id = ANY(%s::uuid[])").format(
            _ident(schema)), (sink, list(ack_ids)))
    return cur.rowcount


def nack(conn: psycopg.Connection[Any], schema: str, sink: str, ack_ids: Sequence[str]) -> int:
    """Make the messages delivered with ``ack_ids`` visible again at once (their ack ids expire)."""
    with conn.transaction():
        cur = conn.execute(sql.SQL(
            "UPDATE {}.stream_messages SET ack_id = NULL, state = 'available', not_visible_until = NULL"
            " WHERE sink = %s AND ack_id = ANY(%s::uuid[])").format(_ident(schema)), (sink, list(ack_ids)))
    return cur.rowcount


def stream_counts(conn: psycopg.Connection[Any], schema: str, sink: str) -> dict[str, int]:
    """Messages of a sink: total, visible, outstanding (received and not yet acked)."""
    row = conn.execute(sql.SQL(
        "SELECT count(*), count(*) FILTER (WHERE commit_lsn <= coalesce((SELECT visible_lsn FROM {0}.stream_visibility"
        " WHERE sink = %s), -1)), count(*) FILTER (WHERE not_visible_until > now())"
        " FROM {0}.stream_messages WHERE sink = %s").format(_ident(schema)), (sink, sink)).fetchone()
    total, visible, outstanding = row if row else (0, 0, 0)
    return {"total": int(total), "visible": int(visible), "outstanding": int(outstanding)}


# ---------------------------------------------------------------------------------------------
# API tokens


class TokenError(ValueError):
    """A token name that is taken, unknown or invalid."""


def hash_token(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(conn: psycopg.Connection[Any], schema: str, name: str) -> str:
    """Create a token called ``name`` and return it; only its hash is stored, so it is shown once.
    A revoked token's name may be reused."""
    if not name or len(name) > 100 or not name.isprintable():
        raise TokenError("a token name is 1-100 printable characters")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with conn.transaction():
        row = conn.execute(sql.SQL(
            "INSERT INTO {0}.api_tokens (name, token_hash) VALUES (%s, %s) ON CONFLICT (name) DO UPDATE"
            " SET token_hash = EXCLUDED.token_hash, created_at = now(), revoked_at = NULL"
            " WHERE {0}.api_tokens.revoked_at IS NOT NULL RETURNING name").format(_ident(schema)),
            (name, hash_token(token))).fetchone()
    if row is None:
        raise TokenError(f"a token named {name!r} exists; revoke it first or pick another name")
    return token


def revoke_token(conn: psycopg.Connection[Any], schema: str, name: str) -> None:
    """Revoke a token: requests carrying it are refused from now on (403)."""
    with conn.transaction():
        cur = conn.execute(sql.SQL("UPDATE {}.api_tokens SET revoked_at = now() WHERE name = %s"
                                   " AND revoked_at IS NULL").format(_ident(schema)), (name,))
    if cur.rowcount == 0:
        raise TokenError(f"no active token named {name!r}")


def list_tokens(conn: psycopg.Connection[Any], schema: str) -> list[tuple[str, datetime, datetime | None]]:
    """(name, created_at, revoked_at) of every token."""
    return [tuple(r) for r in conn.execute(sql.SQL(  # type: ignore[misc]
        "SELECT name, created_at, revoked_at FROM {}.api_tokens ORDER BY name").format(_ident(schema))).fetchall()]


def token_status(conn: psycopg.Connection[Any], schema: str, token: str) -> str:
    """``active``, ``revoked`` or ``unknown``."""
    row = conn.execute(sql.SQL("SELECT revoked_at IS NULL FROM {}.api_tokens WHERE token_hash = %s").format(
        _ident(schema)), (hash_token(token),)).fetchone()
    if row is None:
        return "unknown"
    return "active" if row[0] else "revoked"
