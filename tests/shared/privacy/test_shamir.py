import secrets

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.privacy.errors import NotEnoughShares
from shared.privacy.shamir import PRIME, Share, interpolate, reconstruct_secret, split_secret


@st.composite
def sharings(draw: st.DrawFn) -> tuple[bytes, int, list[Share]]:
    count = draw(st.integers(min_value=1, max_value=12))
    threshold = draw(st.integers(min_value=1, max_value=count))
    points = draw(st.lists(st.integers(min_value=1, max_value=10_000), min_size=count, max_size=count, unique=True))
    secret = draw(st.binary(min_size=32, max_size=32))
    return secret, threshold, split_secret(secret, threshold=threshold, points=points)


@settings(max_examples=60, deadline=None)
@given(sharing=sharings(), data=st.data())
def test_reconstruct_secret_any_threshold_subset_recovers_it(
    sharing: tuple[bytes, int, list[Share]], data: st.DataObject
) -> None:
    secret, threshold, shares = sharing
    size = data.draw(st.integers(min_value=threshold, max_value=len(shares)))
    subset = data.draw(st.permutations(shares))[:size]
    assert reconstruct_secret(subset, threshold=threshold) == secret


@settings(max_examples=30, deadline=None)
@given(sharing=sharings())
def test_reconstruct_secret_below_threshold_raises(sharing: tuple[bytes, int, list[Share]]) -> None:
    _, threshold, shares = sharing
    with pytest.raises(NotEnoughShares):
        reconstruct_secret(shares[: threshold - 1], threshold=threshold)


def test_reconstruct_secret_duplicated_shares_count_once() -> None:
    shares = split_secret(secrets.token_bytes(32), threshold=3, points=[1, 2, 3])
    with pytest.raises(NotEnoughShares):
        reconstruct_secret([shares[0], shares[1], shares[1]], threshold=3)


def test_threshold_minus_one_shares_are_consistent_with_every_secret() -> None:
    # Perfect hiding: for any other secret there is a polynomial of the same degree through
    # (0, other) and the t - 1 observed shares, so those shares cannot tell the two apart.
    threshold = 4
    secret, other = secrets.token_bytes(32), secrets.token_bytes(32)
    seen = split_secret(secret, threshold=threshold, points=[3, 5, 9, 11, 12])[: threshold - 1]
    anchor = Share(0, int.from_bytes(other, "big"))
    forged = Share(7, interpolate([anchor, *seen], at=7, threshold=threshold))
    assert reconstruct_secret([*seen, forged], threshold=threshold) == other


def test_split_secret_shares_are_random_for_the_same_secret() -> None:
    secret = bytes(32)
    first = split_secret(secret, threshold=2, points=[1, 2])
    second = split_secret(secret, threshold=2, points=[1, 2])
    assert first != second
    assert all(0 <= share.y < PRIME for share in first + second)


@pytest.mark.parametrize(
    ("secret", "threshold", "points"),
    [
        (bytes(31), 2, [1, 2]),
        (bytes(32), 3, [1, 2]),
        (bytes(32), 0, [1, 2]),
        (bytes(32), 2, [1, 1]),
        (bytes(32), 1, [0, 1]),
    ],
)
def test_split_secret_bad_arguments_raise(secret: bytes, threshold: int, points: list[int]) -> None:
    with pytest.raises(ValueError):
        split_secret(secret, threshold=threshold, points=points)
