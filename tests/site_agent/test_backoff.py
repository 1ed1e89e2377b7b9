import itertools
import random

import pytest

from site_agent.backoff import exponential, jitter


def test_exponential_grows_then_caps() -> None:
    assert list(itertools.islice(exponential(1.0, factor=2.0, max_delay=10.0), 6)) == [1, 2, 4, 8, 10, 10]


def test_exponential_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        next(exponential(0.0))
    with pytest.raises(ValueError):
        next(exponential(5.0, max_delay=1.0))


def test_jitter_stays_in_upper_half() -> None:
    rng = random.Random(0)
    values = [jitter(8.0, rng) for _ in range(1000)]
    assert min(values) >= 4.0 and max(values) <= 8.0
    assert max(values) - min(values) > 3.0  # really spread, not constant
