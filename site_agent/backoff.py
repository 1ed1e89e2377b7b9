"""Retry delays as data: exponential growth with a cap, and full jitter so sites never poll in lockstep."""

from __future__ import annotations

import random
from collections.abc import Iterator

__all__ = ["exponential", "jitter"]


def exponential(base_delay: float, *, factor: float = 2.0, max_delay: float = 300.0) -> Iterator[float]:
    """base, base*factor, base*factor^2, ... capped at max_delay, forever."""
    if base_delay <= 0 or factor < 1 or max_delay < base_delay:
        raise ValueError("need 0 < base_delay <= max_delay and factor >= 1")
    delay = base_delay
    while True:
        yield delay
        delay = min(delay * factor, max_delay)


def jitter(delay: float, rng: random.Random | None = None) -> float:
    """A delay drawn uniformly from [delay/2, delay]."""
    return (rng or random).uniform(delay / 2, delay)
