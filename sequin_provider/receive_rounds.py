"""Receives of one sink in one API process share one claim at a time (``ReceiveRounds``).

Concurrent receivers of a sink, each claiming its own batch from the stream's head, cost the store
more per message the more of them run at once: each reads the head, and they lock and skip one
another's rows in it (``FOR UPDATE SKIP LOCKED``). Straight against the store, four processes at
batch 100 cost 54 µs of the store's CPU per message where one at batch 400 cost 26, and sixteen at
batch 100 cost 173 (``bench/store_receive_layout.py``, docs/performance.md, "Receives share a
claim"). So an API process runs one claim of a sink at a time: a receive that arrives while one is
in flight waits for it, then the receives waiting claim together, in arrival order, and the
messages are split among them in position order, each getting at most its batch. (Two claims at
once measured no faster, at more of the store's CPU per message.)

Nothing a consumer sees changes but who gets which message: a claim hands out at most one message
per group, so any split keeps every group in order; the sink's ``max_ack_pending`` bounds the round
as it bounded each receive; a receive that gets nothing waits or returns as it did. Several API
processes still claim side by side (``SKIP LOCKED`` keeps them apart)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")

ROUND_MAX = 1000
"""A round claims at most this many messages (or its first receive's batch, when larger): what a
claim costs per message stops falling well before (one process at batch 400 and at batch 1,000 cost
the store the same), and a round's messages are held in memory until they are answered."""


@dataclass(eq=False)
class _Wanted(Generic[T]):
    """One receive waiting for its share: its batch and where its messages go."""

    batch_size: int
    share: asyncio.Future[list[T]]
    taken: bool = False
    """In a round (its own or another's)."""


class ReceiveRounds(Generic[T]):
    """One claim of a sink at a time; receives waiting meanwhile share the next one.

    ``claim(n)`` claims up to ``n`` messages in position order (a thread's store call, in the API).
    Build one per sink and event loop."""

    def __init__(self, claim: Callable[[int], Awaitable[list[T]]], round_max: int = ROUND_MAX) -> None:
        self._claim = claim
        self._round_max = round_max
        self._waiting: deque[_Wanted[T]] = deque()
        self._claiming = asyncio.Lock()

    async def receive(self, batch_size: int) -> list[T]:
        """Up to ``batch_size`` messages, from this receive's own claim or a round it shared."""
        wanted = _Wanted(batch_size, asyncio.get_running_loop().create_future())
        self._waiting.append(wanted)
        try:
            async with self._claiming:
                if not wanted.taken:
                    await asyncio.shield(self._round(wanted))
            return await wanted.share  # its own round's, or one it was taken into meanwhile
        except asyncio.CancelledError:
            if not wanted.taken:
                self._waiting.remove(wanted)
            # Its round goes on for the others (shielded); what it claimed for this receive comes
            # back after the visibility timeout, as for a consumer that died holding it.
            wanted.share.add_done_callback(_retrieved)
            raise

    def _round(self, first: _Wanted[T]) -> asyncio.Task[None]:
        """``first`` and the receives waiting behind it, up to the round's size, taken into one
        claim, run as a task of its own (so a receive cancelled meanwhile does not cancel the
        others' claim)."""
        self._waiting.remove(first)
        taken, total, limit = [first], first.batch_size, max(self._round_max, first.batch_size)
        while self._waiting and total + self._waiting[0].batch_size <= limit:
            taken.append(self._waiting.popleft())
            total += taken[-1].batch_size
        for wanted in taken:
            wanted.taken = True
        return asyncio.ensure_future(self._claim_shares(taken, total))

    async def _claim_shares(self, taken: list[_Wanted[T]], total: int) -> None:
        """Claim ``total`` and hand each receive of ``taken`` its share in order; a failed claim
        fails them all."""
        try:
            got = await self._claim(total)
        except Exception as exc:
            for wanted in taken:
                wanted.share.set_exception(exc)
            return
        start = 0
        for wanted in taken:
            wanted.share.set_result(got[start : start + wanted.batch_size])
            start += wanted.batch_size


def _retrieved(share: asyncio.Future[Any]) -> None:
    """Mark a share nobody will read as retrieved (no "exception was never retrieved" warning)."""
    if not share.cancelled():
        share.exception()
