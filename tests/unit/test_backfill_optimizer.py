"""PageSizeOptimizer on synthetic timings: grows, shrinks, converges, clamps."""

from __future__ import annotations

import random

import pytest

from sequin_provider.backfill import PageSizeOptimizer


def simulate(
    optimizer: PageSizeOptimizer,
    ms_per_row: float,
    overhead_ms: float = 2.0,
    steps: int = 60,
    noise: float = 0.0,
    seed: int = 1,
) -> list[tuple[int, float, bool]]:
    """Run pages against a linear cost model; a page over the budget times out."""
    rng = random.Random(seed)
    trace = []
    for _ in range(steps):
        size = optimizer.size
        elapsed = (overhead_ms + size * ms_per_row) * (1 + rng.uniform(-noise, noise))
        timed_out = elapsed >= optimizer.max_query_ms
        trace.append((size, elapsed, timed_out))
        optimizer.observe(size, min(elapsed, optimizer.max_query_ms), timed_out)
    return trace


def test_grows_from_a_small_page_towards_the_target_within_2x_steps() -> None:
    opt = PageSizeOptimizer(max_query_ms=1000, initial_size=100, max_size=10_000_000)
    trace = simulate(opt, ms_per_row=0.001)  # target 500 ms -> about 500,000 rows
    sizes = [s for s, _, _ in trace]
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))  # never more than doubling
    assert not any(t for _, _, t in trace)
    assert 400_000 <= sizes[-1] <= 600_000
    assert all(e < 1000 for _, e, _ in trace)


def test_shrinks_on_timeouts_by_at_most_half_a_step_and_settles_under_the_budget() -> None:
    opt = PageSizeOptimizer(max_query_ms=100, initial_size=100_000)
    trace = simulate(opt, ms_per_row=0.01)  # 100,000 rows take 1,000 ms: 10x the budget
    sizes = [s for s, _, _ in trace]
    assert trace[0][2]  # the first page timed out
    assert all(b >= a // 2 for a, b in zip(sizes, sizes[1:]))  # never less than halving
    tail = trace[-20:]
    assert not any(t for _, _, t in tail)
    assert all(25 <= e <= 100 for _, e, _ in tail)  # near the 50 ms target, under the budget


def test_a_timeout_is_a_measurement_at_the_budget_not_ignored() -> None:
    opt = PageSizeOptimizer(max_query_ms=100, initial_size=1000)
    opt.observe(1000, 10)  # fast: would grow to 2000
    assert opt.size == 2000
    opt.observe(2000, 0, timed_out=True)  # elapsed reported as 0 must not look fast
    assert opt.size <= 1000
    assert opt.observations[-1].elapsed_ms == 100


def test_converges_between_largest_success_and_smallest_timeout() -> None:
    opt = PageSizeOptimizer(max_query_ms=100, initial_size=1000, target_fraction=0.9)
    opt.observe(1000, 50)
    opt.observe(2000, 100, timed_out=True)
    for _ in range(5):
        opt.observe(opt.size, 60)
        assert 1000 <= opt.size < 2000


def test_noisy_timings_still_respect_budget_most_of_the_time() -> None:
    opt = PageSizeOptimizer(max_query_ms=200, initial_size=50)
    trace = simulate(opt, ms_per_row=0.05, noise=0.3, steps=200)
    timeouts = sum(t for _, _, t in trace[50:])
    assert timeouts <= 5
    assert min(s for s, _, _ in trace[50:]) >= 500  # and pages stay large: 2,000 rows is the target


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_query_ms": 0}, "max_query_ms"),
        ({"target_fraction": 1.5}, "target_fraction"),
        ({"min_size": 0}, "min_size"),
        ({"min_size": 10, "max_size": 5}, "min_size"),
    ],
)
def test_bad_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PageSizeOptimizer(**kwargs)  # type: ignore[arg-type]


def test_bounds_and_zero_time() -> None:
    opt = PageSizeOptimizer(max_query_ms=100, initial_size=5, min_size=10, max_size=50)
    assert opt.size == 10
    for _ in range(10):
        opt.observe(opt.size, 0)
    assert opt.size == 50
    with pytest.raises(ValueError):
        opt.observe(0, 1)
