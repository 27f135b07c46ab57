"""Consumer-group queries on a Sequin Stream sink's messages (DESIGN §9, reference/002).

A consumer group shares one stream. ``receive`` hands out visible messages (at or below the sink's
visibility watermark, and no backfill read whose window is still open), at most one per group and
never one whose group has an earlier message still in the table (outstanding, or not yet acked), so
a group is processed strictly in order. A truncate is a barrier for its table across groups: it
is handed out only when no earlier message of its table is in the table, and no later message of
its table while it is (its ``barrier`` column, migration 12).
Received messages are invisible for the visibility timeout; ``ack`` deletes them (and keeps their
positions in the acked ledger until the slot has passed them, so a replayed micro-batch does not
bring them back: a sink is one consumer group), ``nack`` makes them visible at once; an ack id
carries its message's position (``ack_ids``). Concurrent receivers
never get the same message: rows are claimed with ``FOR UPDATE SKIP LOCKED``. API tokens are stored
as SHA-256 hashes only.
The queries are the store's (``store.stream_queue``, ``store.tokens``); this module decides how much a
receive reads and claims, makes and parses ack ids, and makes, hashes and checks tokens.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from contextlib import suppress
from typing import Any, NamedTuple, Sequence

import psycopg

from sequin_provider import ack_ids as ack_id_codec
from sequin_provider import store
from sequin_provider.exceptions import SequinError

TOKEN_PREFIX = "sqn_"


class Delivery(NamedTuple):
    """One received message: the id to ack/nack it with and its JSON text."""

    ack_id: str
    data: str


RECOUNT_SECONDS = 5.0
HEAD_ROOM = 2
"""A receive first reads its pending messages and this many times the batch of the stream's head
(``receive``). Two, not four since receives share a claim: a sink's claims in an API process no
longer skip one another's rows, and a head half as long cost the store a fifth less per message
(docs/performance.md, "A receive's head")."""
HEAD_GROWTH = 4
"""A receive that claimed too few from the part of the head it read reads this many times more."""


def receive(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str,
    batch_size: int,
    visibility_timeout: float,
    max_ack_pending: int,
) -> list[Delivery]:
    """Claim up to ``batch_size`` deliverable messages of ``sink`` for ``visibility_timeout`` seconds.

    A message is deliverable when it is its group's first in the stream table (so a group goes
    strictly in position order), visible, not received or its visibility timed out, and not on the
    wrong side of a truncate of its table (a truncate waits for every earlier message of its table,
    later ones wait for it: its ``barrier``, the group-id prefix of its table). Those are
    found in the stream's head: the messages in position order from the oldest, where every
    earlier message of a group lies before its later ones. A receive reads a head of its pending
    messages and ``HEAD_ROOM`` times the batch (room for what concurrent receivers are claiming:
    those are skipped, ``SKIP LOCKED``, not waited for), and reads ``HEAD_GROWTH`` times more while it
    claimed too few and the stream holds more. So the stream table needs no index on groups: a
    cheaper write per message. The same holds for barriers: whatever lies before a message of the
    head is in the head. The head's truncates are materialized once, so a stream without any
    costs one empty anti-join (a receive of 100 from 20,000 messages: 22.5 ms median, as before).

    When ``max_ack_pending`` messages are pending (received and neither acked nor nacked, including
    those whose visibility timed out), no new messages are handed out, only redeliveries. The
    pending count is the sink's ``stream_pending`` counter, which every receive, ack and nack keeps
    in its own transaction; when it reads full, it is recounted (at most every ``RECOUNT_SECONDS``)
    so a counter gone wrong behind our back (a manual DELETE) cannot stall the sink.

    Most receives are one statement (``store.claim_first``): on an autocommit connection, one
    round trip. When it claimed too few from a full head, or the counter read full, the rest runs
    in a transaction of its own; on an autocommit connection the first claim is committed by then,
    and if the rest fails its messages are released (with the store gone in between they stay
    received by nobody until their visibility times out, as for a consumer that died holding them).
    """
    first = store.claim_first(
        conn, schema, sink, batch_size, max_ack_pending, HEAD_ROOM, visibility_timeout, ack_id_codec.NONCE_LIMIT
    )
    if first is None:
        return []
    claimed = first.claimed
    if first.pending < max_ack_pending and (len(claimed) >= first.claim or first.in_head < first.head):
        return _deliveries(claimed)  # the common case: one statement
    try:
        claimed = _claim_more(conn, schema, sink, batch_size, visibility_timeout, max_ack_pending, first)
    except psycopg.Error:
        if first.claimed and conn.autocommit:  # committed already: give them back if the store lets us
            with suppress(psycopg.Error):
                store.release_messages(conn, schema, sink, _positions(first.claimed))
        raise
    return _deliveries(claimed)


def _claim_more(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str,
    batch_size: int,
    visibility_timeout: float,
    max_ack_pending: int,
    first: store.FirstClaim,
) -> list[store.Claimed]:
    """The rest of a receive whose first statement (``first``) claimed too few from a full head, or
    found its sink full, in a transaction: ``first``'s messages and those claimed now."""
    claimed = first.claimed
    with conn.transaction():
        if first.pending < max_ack_pending:  # its head was too short for the claim: read on
            only_redeliveries, limit, head = False, first.claim, first.head * HEAD_GROWTH
        else:
            outstanding = store.recount_pending(conn, schema, sink, first.pending, RECOUNT_SECONDS)
            only_redeliveries = outstanding >= max_ack_pending
            limit = batch_size if only_redeliveries else min(batch_size, max_ack_pending - outstanding)
            head = outstanding + HEAD_ROOM * limit
        while len(claimed) < limit:
            got, in_head = store.claim_from_head(
                conn,
                schema,
                sink,
                first.visible,
                head,
                only_redeliveries,
                limit - len(claimed),
                visibility_timeout,
                ack_id_codec.NONCE_LIMIT,
            )
            claimed = claimed + got
            # Read further while too few were claimed and the head did not hold every visible
            # message: too few deliverable ones in it, or other receivers hold them (skipped,
            # not waited for). The ones claimed stay in the head, now received.
            if in_head < head:
                break
            head *= HEAD_GROWTH
    return claimed


def _positions(claimed: list[store.Claimed]) -> store.Deliveries:
    """Claimed messages as ``store.Deliveries`` (positions and nonces)."""
    return [c[0] for c in claimed], [c[1] for c in claimed], [c[2] for c in claimed]


def _deliveries(claimed: list[store.Claimed]) -> list[Delivery]:
    """Claimed messages in position order, with their ack ids."""
    in_order = sorted(claimed)
    return [Delivery(ack_id, row[3]) for ack_id, row in zip(ack_id_codec.ack_ids(in_order), in_order)]


def ack(conn: psycopg.Connection[Any], schema: str, sink: str, ack_ids: Sequence[str | uuid.UUID]) -> int:
    """Delete the messages delivered with ``ack_ids``; unknown, expired or repeated ids are ignored.

    An acked message never comes back to the sink's consumer group: its position stays in the
    acked ledger until the slot has passed it (``store.prune_acked``), so a micro-batch replayed
    after a crash of the stream app skips it; and the ack is durable when it returns (a crash of
    the store does not undo an ack its consumer was told of)."""
    return store.ack_messages(conn, schema, sink, ack_id_codec.positions(ack_ids))


def nack(conn: psycopg.Connection[Any], schema: str, sink: str, ack_ids: Sequence[str | uuid.UUID]) -> int:
    """Make the messages delivered with ``ack_ids`` visible again at once (their ack ids expire)."""
    return store.nack_messages(conn, schema, sink, ack_id_codec.positions(ack_ids))


def release(conn: psycopg.Connection[Any], schema: str, sink: str, ack_ids: Sequence[str | uuid.UUID]) -> int:
    """Give back messages claimed for a client that disconnected before their answer was sent: a
    nack that also takes back the delivery count, since nobody received them (a message claimed
    again since, with another ack id, is left alone)."""
    return store.release_messages(conn, schema, sink, ack_id_codec.positions(ack_ids))


# ---------------------------------------------------------------------------------------------
# API tokens


class TokenError(SequinError, ValueError):
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
    if not store.add_api_token(conn, schema, name, hash_token(token)):
        raise TokenError(f"a token named {name!r} exists; revoke it first or pick another name")
    return token


def revoke_token(conn: psycopg.Connection[Any], schema: str, name: str) -> None:
    """Revoke a token: requests carrying it are refused from now on (403)."""
    if store.revoke_api_token(conn, schema, name) == 0:
        raise TokenError(f"no active token named {name!r}")


def token_status(conn: psycopg.Connection[Any], schema: str, token: str) -> str:
    """``active``, ``revoked`` or ``unknown``."""
    active = store.api_token_active(conn, schema, hash_token(token))
    if active is None:
        return "unknown"
    return "active" if active else "revoked"
