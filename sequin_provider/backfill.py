"""Backfills: keyset pages sized to a query-time budget (DESIGN §7, reference/000 and 004).

This module holds the parts of a backfill that need neither Spark nor Airflow. So far:
``PageSizeOptimizer``, which picks the next keyset page size from how long recent pages took.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PageObservation:
    """One page query: how many rows were asked for, how long it took, whether it hit the budget."""

    page_size: int
    elapsed_ms: float
    timed_out: bool


class PageSizeOptimizer:
    """Chooses keyset page sizes so each page query finishes comfortably inside ``max_query_ms``.

    It models a page's time as proportional to its size, estimated from the last ``history``
    observations, and aims at ``target_fraction`` of the budget. A timed-out query counts as a
    measurement at the budget (the real time was at least that). Pages grow while queries finish
    well under the budget and shrink on timeouts; each step is clamped to 0.5×–2× of the current
    size, and the size stays below the smallest recent timeout and, after a timeout, converges
    between the largest recent success and that timeout.
    """

    def __init__(self, max_query_ms: float = 5000.0, initial_size: int = 1000, min_size: int = 10,
                 max_size: int = 1_000_000, target_fraction: float = 0.5, history: int = 20) -> None:
        if max_query_ms <= 0:
            raise ValueError("max_query_ms must be positive")
        if not 0 < target_fraction < 1:
            raise ValueError("target_fraction must be between 0 and 1")
        if not 1 <= min_size <= max_size:
            raise ValueError("need 1 <= min_size <= max_size")
        self.max_query_ms = max_query_ms
        self.min_size = min_size
        self.max_size = max_size
        self.target_fraction = target_fraction
        self._size = min(max(initial_size, min_size), max_size)
        self._history: deque[PageObservation] = deque(maxlen=history)

    @property
    def size(self) -> int:
        """The page size to use for the next query."""
        return self._size

    @property
    def observations(self) -> tuple[PageObservation, ...]:
        """The recent observations the estimate is based on (oldest first)."""
        return tuple(self._history)

    def observe(self, page_size: int, elapsed_ms: float, timed_out: bool = False) -> int:
        """Record a page query and return the next page size."""
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        elapsed = self.max_query_ms if timed_out else max(float(elapsed_ms), 0.0)
        self._history.append(PageObservation(page_size, elapsed, timed_out))
        self._size = self._next_size(page_size)
        return self._size

    def _next_size(self, current: int) -> int:
        target_ms = self.target_fraction * self.max_query_ms
        # ms per row from the recent pages (a timeout contributes budget / size: a lower bound)
        rates = sorted(o.elapsed_ms / o.page_size for o in self._history)
        ms_per_row = rates[len(rates) // 2]
        proposed = self.max_size if ms_per_row <= 0 else int(target_ms / ms_per_row)
        proposed = max(int(current * 0.5), min(proposed, current * 2))  # one step: 0.5x .. 2x
        timeouts = [o.page_size for o in self._history if o.timed_out]
        if timeouts:
            smallest_timeout = min(timeouts)
            if self._history[-1].timed_out:
                proposed = min(proposed, max(int(current * 0.5), 1))
            successes = [o.page_size for o in self._history if not o.timed_out and o.page_size < smallest_timeout]
            ceiling = smallest_timeout - 1
            if successes and proposed >= smallest_timeout:
                ceiling = (max(successes) + smallest_timeout) // 2  # bisect between success and timeout
            proposed = min(proposed, max(ceiling, 1))
        return min(max(proposed, self.min_size), self.max_size)
