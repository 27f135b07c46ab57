"""Exponential backoff: the one formula behind every "wait longer after each failure" of Sequin."""

from __future__ import annotations

import random


def exponential_backoff(
    attempt: int, initial: float, maximum: float, jitter: float = 0.0, rng: random.Random | None = None
) -> float:
    """Delay before retry number ``attempt`` (1-based; 0 counts as 1): ``initial`` doubling with each
    attempt, capped at ``maximum``, then spread by +/- ``jitter`` (a fraction, e.g. 0.15)."""
    base = min(float(initial) * 2 ** max(attempt - 1, 0), float(maximum))
    return base * (1 + (rng or random).uniform(-jitter, jitter)) if jitter else base
