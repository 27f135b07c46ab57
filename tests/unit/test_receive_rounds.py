"""``receive_rounds.ReceiveRounds``: who claims, and what each receive gets, when receives of a sink
overlap. The claim here is a stand-in that hands out numbered messages when the test lets it: what
is tested is the scheduling. The store's claim under it is tested over HTTP
(tests/integration/stream_api/test_stream_api.py, receives sharing a claim)."""

from __future__ import annotations

import asyncio
from typing import Any

from sequin_provider.receive_rounds import ReceiveRounds


class GivenBack:
    """What the rounds gave back (``abandon``)."""

    def __init__(self) -> None:
        self.messages: list[int] = []

    async def __call__(self, messages: list[int]) -> None:
        self.messages += messages


def rounds_of(claims: HeldClaims, round_max: int = 1000) -> tuple[ReceiveRounds[int], GivenBack]:
    given_back = GivenBack()
    return ReceiveRounds(claims, given_back, round_max), given_back


class HeldClaims:
    """Claims that wait until the test lets them through: all of them (``release``), or the n-th
    alone (``let(n)``); each hands out the next ``available`` numbers."""

    def __init__(self, available: int = 10_000, fail: BaseException | None = None) -> None:
        self.asked: list[int] = []
        self.release = asyncio.Event()
        self.gates: dict[int, asyncio.Event] = {}
        self.next = 0
        self.available = available
        self.fail = fail

    def let(self, n: int) -> None:
        self.gates.setdefault(n, asyncio.Event()).set()

    async def __call__(self, n: int) -> list[int]:
        self.asked.append(n)
        gate = self.gates.setdefault(len(self.asked) - 1, asyncio.Event())
        await next(
            asyncio.as_completed([asyncio.ensure_future(self.release.wait()), asyncio.ensure_future(gate.wait())])
        )
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
        rounds, given_back = rounds_of(claims)
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
        rounds, given_back = rounds_of(claims)
        tasks = await started(rounds, 10, 5, 5)
        claims.release.set()
        assert await asyncio.gather(*tasks) == [list(range(10)), [10, 11, 12, 13, 14], [15, 16]]

    run(scenario())


def test_a_round_claims_at_most_its_size_and_the_rest_wait_for_the_next() -> None:
    async def scenario() -> None:
        claims = HeldClaims()
        rounds, _ = rounds_of(claims, round_max=10)
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
        rounds, given_back = rounds_of(claims)
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
        rounds, given_back = rounds_of(claims)
        first, cancelled, last = await started(rounds, 10, 5, 5)
        cancelled.cancel()
        await asyncio.sleep(0)
        claims.release.set()
        assert await first == list(range(10))
        assert await last == list(range(10, 15))
        assert cancelled.cancelled() and claims.asked == [10, 5] and given_back.messages == []

    run(scenario())


def test_receives_cancelled_while_their_round_claims_leave_it_to_the_others_and_give_theirs_back() -> None:
    """The round goes on (shielded, holding the sink's one claim) for the receives still there; the
    shares of the cancelled ones are given back (in the API: released, visible again at once)."""

    async def scenario() -> None:
        claims = HeldClaims()
        rounds, given_back = rounds_of(claims)
        first, *others = await started(rounds, 10, 5, 5, 5)
        claims.let(0)
        assert await first == list(range(10))
        leader, taken, last = others
        await asyncio.sleep(0)
        assert claims.asked == [10, 15]  # the three waiting claim together, the claim held
        leader.cancel()  # the receive that started the round
        await asyncio.sleep(0)
        taken.cancel()  # one taken into it, waiting for its share
        await asyncio.sleep(0)
        later = asyncio.create_task(rounds.receive(5))
        await asyncio.sleep(0)
        assert claims.asked == [10, 15]  # the round still holds the sink's one claim
        claims.release.set()
        assert await last == list(range(20, 25))
        assert await later == list(range(25, 30))
        assert leader.cancelled() and taken.cancelled()
        await asyncio.sleep(0)
        assert sorted(given_back.messages) == list(range(10, 20))

    run(scenario())


def test_a_receive_whose_client_is_known_gone_is_left_out_of_its_round() -> None:
    async def scenario() -> None:
        claims = HeldClaims()
        rounds, _ = rounds_of(claims)
        first = asyncio.create_task(rounds.receive(10))
        await asyncio.sleep(0)
        gone = asyncio.create_task(rounds.receive(5, gone=lambda: True))
        live = asyncio.create_task(rounds.receive(5))
        await asyncio.sleep(0)
        claims.release.set()
        assert (await first, await gone, await live) == (list(range(10)), [], list(range(10, 15)))
        assert claims.asked == [10, 5]

    run(scenario())
