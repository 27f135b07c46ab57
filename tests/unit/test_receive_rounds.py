"""``receive_rounds.ReceiveRounds``: who claims, and what each receive gets, when receives of a sink
overlap. The claim here is a stand-in that hands out numbered messages when the test lets it: what
is tested is the scheduling. The store's claim under it is tested over HTTP
(tests/integration/stream_api/test_stream_api.py, receives sharing a claim)."""

from __future__ import annotations

import asyncio
from typing import Any

from sequin_provider.receive_rounds import ReceiveRounds


class HeldClaims:
    """Claims that wait until the test releases them; each hands out the next ``available`` numbers."""

    def __init__(self, available: int = 10_000, fail: BaseException | None = None) -> None:
        self.asked: list[int] = []
        self.release = asyncio.Event()
        self.next = 0
        self.available = available
        self.fail = fail

    async def __call__(self, n: int) -> list[int]:
        self.asked.append(n)
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        got = list(range(self.next, min(self.next + n, self.available)))
        self.next += len(got)
        return got


async def started(rounds: ReceiveRounds[int], *batches: int) -> list[asyncio.Task[list[int]]]:
    """Receives started in this order, each given the loop until it waits."""
    tasks = []
    for batch in batches:
        tasks.append(asyncio.create_task(rounds.receive(batch)))
        await asyncio.sleep(0)
    return tasks


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_receives_waiting_for_a_claim_share_the_next_one_in_arrival_order() -> None:
    async def scenario() -> None:
        claims = HeldClaims()
        rounds = ReceiveRounds(claims)
        tasks = await started(rounds, 10, 5, 5, 3)
        assert claims.asked == [10]  # the first claims alone; the others wait for it
        claims.release.set()
        results = await asyncio.gather(*tasks)
        assert claims.asked == [10, 13]
        assert results == [list(range(10)), list(range(10, 15)), list(range(15, 20)), list(range(20, 23))]

    run(scenario())


def test_a_short_claim_goes_to_the_earliest_receives_first() -> None:
    async def scenario() -> None:
        claims = HeldClaims(available=17)
        rounds = ReceiveRounds(claims)
        tasks = await started(rounds, 10, 5, 5)
        claims.release.set()
        assert await asyncio.gather(*tasks) == [list(range(10)), [10, 11, 12, 13, 14], [15, 16]]

    run(scenario())


def test_a_round_claims_at_most_its_size_and_the_rest_wait_for_the_next() -> None:
    async def scenario() -> None:
        claims = HeldClaims()
        rounds = ReceiveRounds(claims, round_max=10)
        tasks = await started(rounds, 4, 4, 4, 4, 20)
        claims.release.set()
        results = await asyncio.gather(*tasks)
        assert claims.asked == [4, 8, 4, 20]  # a receive larger than a round claims alone
        assert [len(r) for r in results] == [4, 4, 4, 4, 20]
        assert sorted(n for r in results for n in r) == list(range(36))

    run(scenario())


def test_a_failed_claim_fails_every_receive_of_its_round_and_the_next_round_claims_again() -> None:
    async def scenario() -> None:
        claims = HeldClaims(fail=ConnectionError("store down"))
        rounds = ReceiveRounds(claims)
        tasks = await started(rounds, 1, 2, 3)
        claims.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [type(r) for r in results] == [ConnectionError] * 3
        claims.fail = None
        assert await rounds.receive(2) == [0, 1]
        assert claims.asked == [1, 5, 2]

    run(scenario())


def test_a_receive_cancelled_while_it_waits_is_left_out_of_the_round() -> None:
    async def scenario() -> None:
        claims = HeldClaims()
        rounds = ReceiveRounds(claims)
        first, cancelled, last = await started(rounds, 10, 5, 5)
        cancelled.cancel()
        await asyncio.sleep(0)
        claims.release.set()
        assert await first == list(range(10))
        assert await last == list(range(10, 15))
        assert cancelled.cancelled() and claims.asked == [10, 5]

    run(scenario())


def test_a_receive_cancelled_while_its_round_claims_leaves_the_round_to_the_others() -> None:
    """The round goes on (shielded): the others get their shares; the cancelled receive's share was
    claimed for nobody (in the API: back after the visibility timeout, as for a consumer that died)."""

    async def scenario() -> None:
        claims = HeldClaims()
        rounds = ReceiveRounds(claims)
        first, *others = await started(rounds, 10, 5, 5)
        claims.release.set()
        assert await first == list(range(10))
        claims.release.clear()
        leader, follower = others
        await asyncio.sleep(0)
        assert claims.asked == [10, 10]  # the two waiting claim together, the claim held
        leader.cancel()
        await asyncio.sleep(0)
        claims.release.set()
        assert await follower == list(range(15, 20))
        assert leader.cancelled()

    run(scenario())
