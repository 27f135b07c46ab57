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

The guarantees do not change, only which consumer gets which message: a claim hands out at most
one message per group, so any split keeps every group in order; the sink's ``max_ack_pending``
bounds the round as it bounded each receive; a receive that gets nothing waits or returns as it
did. What a consumer may notice: a receive can wait for the claim in flight before its own round
(one claim's time), and a claim that fails fails every receive of its round (the API answers each
503). A receive whose client is known to have gone is left out of the round it would join; one
cancelled while its round claims gets its messages given back (``abandon``). Several API processes
still claim side by side (``SKIP LOCKED`` keeps them apart)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Generic, TypeVar

T = TypeVar("T")

ROUND_MAX = 1000
"""A round claims at most this many messages (or its first receive's batch, when larger): what a
claim costs per message stops falling well before (one process at batch 400 and at batch 1,000 cost
the store the same), and a round's messages are held in memory until they are answered."""


@dataclass(eq=False)
class _Wanted(Generic[T]):
    """One receive waiting for its share: its batch, where its messages go, and whether its client
    is known to be gone (then it is left out of a round)."""

    batch_size: int
    share: asyncio.Future[list[T]]
    gone: Callable[[], bool]
    taken: bool = False
    """In a round (its own or another's)."""


class ReceiveRounds(Generic[T]):
    """One claim of a sink at a time; receives waiting meanwhile share the next one.

    ``claim(n)`` claims up to ``n`` messages in position order (a thread's store call, in the API);
    ``abandon(messages)`` gives back messages claimed for a receive that was cancelled before it
    got them (the API releases them: visible again at once). Build one per sink and event loop."""

    def __init__(
        self,
        claim: Callable[[int], Awaitable[list[T]]],
        abandon: Callable[[list[T]], Awaitable[None]],
        round_max: int = ROUND_MAX,
    ) -> None:
        self._claim = claim
        self._abandon = abandon
        self._round_max = round_max
        self._waiting: deque[_Wanted[T]] = deque()
        self._claiming = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()  # rounds and give-backs running (strong references)

    async def receive(self, batch_size: int, gone: Callable[[], bool] = lambda: False) -> list[T]:
        """Up to ``batch_size`` messages, from this receive's own claim or a round it shared;
        nothing when ``gone()`` (its client is known to have left) by the time a round would take it."""
        wanted = _Wanted(batch_size, asyncio.get_running_loop().create_future(), gone)
        self._waiting.append(wanted)
        try:
            await self._claiming.acquire()  # FIFO: every receive that came before has had its round
            if wanted.taken:
                self._claiming.release()
            else:  # the lock is held until its round ends, even if this receive is cancelled meanwhile
                await asyncio.shield(self._round(wanted))
            return await asyncio.shield(wanted.share)  # its own round's, or one it was taken into
        except asyncio.CancelledError:
            if not wanted.taken:
                self._waiting.remove(wanted)
            wanted.share.add_done_callback(self._give_back)
            raise

    def _round(self, first: _Wanted[T]) -> asyncio.Task[None]:
        """``first`` and the receives waiting behind it, up to the round's size, taken into one
        claim run as a task of its own (a receive cancelled meanwhile does not cancel the others'
        claim), which releases the lock when it ends."""
        self._waiting.remove(first)
        taken, total, limit = [first], first.batch_size, max(self._round_max, first.batch_size)
        while self._waiting and total + self._waiting[0].batch_size <= limit:
            taken.append(self._waiting.popleft())
            total += taken[-1].batch_size
        live = []
        for wanted in taken:
            wanted.taken = True
            if wanted.gone():
                wanted.share.set_result([])
            else:
                live.append(wanted)
        task = self._run(self._claim_shares(live, sum(w.batch_size for w in live)))
        task.add_done_callback(lambda _: self._claiming.release())
        return task

    async def _claim_shares(self, taken: list[_Wanted[T]], total: int) -> None:
        """Claim ``total`` and hand each receive of ``taken`` its share in order; a failed claim
        fails them all."""
        try:
            got = await self._claim(total) if taken else []
        except Exception as exc:  # each receive raises it (the API answers 503 for a store down)
            for wanted in taken:
                wanted.share.set_exception(exc)
            return
        except BaseException:  # the round itself cancelled (the loop is closing): so are its receives
            for wanted in taken:
                wanted.share.cancel()
            raise
        start = 0
        for wanted in taken:
            wanted.share.set_result(got[start : start + wanted.batch_size])
            start += wanted.batch_size

    def _give_back(self, share: asyncio.Future[list[T]]) -> None:
        """A share nobody will read (its receive was cancelled): its messages given back."""
        if not share.cancelled() and share.exception() is None and share.result():
            self._run(self._abandon(share.result()))

    def _run(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task kept referenced until it ends."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
