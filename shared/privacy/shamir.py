"""Shamir t-of-n secret sharing of 32-byte secrets over the prime field GF(2^521 - 1) (Shamir, CACM 1979).

A secret s is the constant term of a random polynomial f of degree t - 1; the share for the
point x >= 1 is (x, f(x)). Any t shares determine f, hence s = f(0), by Lagrange interpolation;
any t - 1 shares are consistent with every possible secret (each choice of s gives exactly one
polynomial through them), so they reveal nothing. Points are site numbers in the round.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.errors import PrivacyInputError
from shared.privacy.errors import NotEnoughShares

__all__ = [
    "PRIME",
    "SECRET_BYTES",
    "SHARE_BYTES",
    "Share",
    "interpolate",
    "reconstruct_secret",
    "split_secret",
]

PRIME = 2**521 - 1  # Mersenne prime: every 32-byte secret is a field element, with room to spare
SECRET_BYTES = 32
SHARE_BYTES = (PRIME.bit_length() + 7) // 8  # 66: a field element, big-endian


@dataclass(frozen=True)
class Share:
    """One point (x, f(x)) of a sharing polynomial; x is the holder's site number."""

    x: int
    y: int

    def y_bytes(self) -> bytes:
        """The value f(x) as SHARE_BYTES big-endian bytes."""
        return self.y.to_bytes(SHARE_BYTES, "big")


def split_secret(secret: bytes, *, threshold: int, points: Sequence[int]) -> list[Share]:
    """Share `secret` among `points` (distinct, >= 1) so that any `threshold` of the shares recover it."""
    if len(secret) != SECRET_BYTES:
        raise PrivacyInputError(f"secrets are {SECRET_BYTES} bytes, got {len(secret)}")
    if len(set(points)) != len(points) or any(not 0 < x < PRIME for x in points):
        raise PrivacyInputError("share points must be distinct integers in [1, PRIME)")
    if not 1 <= threshold <= len(points):
        raise PrivacyInputError(f"threshold {threshold} must lie in [1, {len(points)}]")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return [Share(x, _evaluate(coefficients, x)) for x in points]


def reconstruct_secret(shares: Iterable[Share], *, threshold: int) -> bytes:
    """Recover the secret from at least `threshold` shares with distinct points; raise NotEnoughShares otherwise."""
    value = interpolate(shares, at=0, threshold=threshold)
    if value >= 1 << (8 * SECRET_BYTES):
        raise PrivacyInputError("the shares do not encode a secret of this length (inconsistent shares)")
    return value.to_bytes(SECRET_BYTES, "big")


def interpolate(shares: Iterable[Share], *, at: int, threshold: int) -> int:
    """Evaluate at `at` the polynomial of degree threshold - 1 through the first `threshold` distinct shares."""
    distinct = list({share.x: share for share in shares}.values())
    if len(distinct) < threshold:
        raise NotEnoughShares(f"{len(distinct)} distinct shares, the threshold is {threshold}")
    used = distinct[:threshold]
    total = 0
    for i, share in enumerate(used):
        numerator, denominator = 1, 1
        for j, other in enumerate(used):
            if i != j:
                numerator = numerator * (at - other.x) % PRIME
                denominator = denominator * (share.x - other.x) % PRIME
        total = (total + share.y * numerator * pow(denominator, -1, PRIME)) % PRIME
    return total


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """Horner's rule in the field, lowest coefficient first."""
    value = 0
    for coefficient in reversed(coefficients):
        value = (value * x + coefficient) % PRIME
    return value
