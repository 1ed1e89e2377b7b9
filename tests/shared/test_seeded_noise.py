"""The simulation's DP noise derives from a label; the service's comes from the operating system."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from shared.study.dp import noise_source, seeded_noise

VARIANCE = Fraction(10_000)


def draws(count: int = 3) -> list[np.ndarray]:
    """`count` sources' first 64 samples, one source after another."""
    return [noise_source().sample(64, VARIANCE) for _ in range(count)]


def test_without_a_label_every_source_has_a_key_of_its_own() -> None:
    first, second = draws(2)
    assert not np.array_equal(first, second)
    assert not np.array_equal(draws(1)[0], draws(1)[0])  # nothing repeats from one release to the next


def test_a_label_fixes_each_sources_key_by_its_rank() -> None:
    with seeded_noise("5|1|site-1"):
        once = draws()
    with seeded_noise("5|1|site-1"):
        again = draws()
    assert all(np.array_equal(a, b) for a, b in zip(once, again, strict=True))
    assert not np.array_equal(once[0], once[1])  # the second source of a round is not the first again
    with seeded_noise("5|1|site-2"):
        other = draws()
    assert not any(np.array_equal(a, b) for a, b in zip(once, other, strict=True))
    assert np.std(np.concatenate(once)) > 50  # noise of the asked variance (sigma 100), not zeros


def test_labels_nest_and_end_with_their_block() -> None:
    with seeded_noise("outer"):
        (outer_first,) = draws(1)
        with seeded_noise("inner"):
            (inner,) = draws(1)
        (outer_second,) = draws(1)
    with seeded_noise("outer"):
        expected = draws(2)
    with seeded_noise("inner"):
        (inner_again,) = draws(1)
    assert np.array_equal(outer_first, expected[0]) and np.array_equal(outer_second, expected[1])
    assert np.array_equal(inner, inner_again)
    after = draws(2)  # outside every block: keys from the OS again
    assert not np.array_equal(after[0], after[1])
