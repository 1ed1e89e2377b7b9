"""Exact discrete Gaussian noise on the integers, and conditional randomized rounding onto them.

`DiscreteGaussian` samples N_Z(0, s2): P(x) proportional to exp(-x^2 / (2 s2)) for every integer
x, s2 a rational variance, by Canonne, Kamath and Steinke's rejection sampler ("The Discrete
Gaussian for Differential Privacy", NeurIPS 2020, Algorithm 3): with t = floor(sqrt(s2)) + 1,
draw Y from the discrete Laplace of scale t (here a geometric G with P(G >= k) = exp(-k / t) and
a fair sign, a negative zero drawn again) and keep it with probability exp(-(|Y| - s2 / t)^2 / (2 s2)).

The sampler is exact, not an approximation within a statistical distance: every decision compares a
uniform U in (0, 1) with a threshold exp(-r) (G >= k iff -ln U >= k / t; keep iff -ln U > gamma),
and U is drawn lazily. Its first 53 bits decide in float64 whenever the certified error margin of the
computed logarithm (REL, far above the < 1 ulp of libm's log) leaves no doubt, which is all but about
one decision in 2^20; the others are settled exactly with `decimal` logarithms at growing precision
and further bits of the same U, so the output's law is N_Z(0, s2) itself (no floating-point
Gaussian, no truncated support: Mironov 2012; Jin et al., S&P 2022). Bits come from an AES-128-CTR
keystream keyed with 32 bytes of the operating system's randomness (`secrets`) unless a test gives
the key, read in one fixed order, so a given key gives the same samples on every platform.

`conditional_round` puts a real vector (in units of the grid) on the integers by randomized
rounding, kept only if its L2 norm stays within a bound (Kairouz, Liu and Steinke, ICML 2021, §4):
with the bound ||x|| + sqrt(d) / 2 it is kept almost always, and rounding to the nearest integer,
which never exceeds it, is the fallback; the bound is what the sensitivity is computed from.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from decimal import Context, Decimal
from fractions import Fraction
from typing import TypeVar

import numpy as np

from shared.errors import PrivacyInputError
from shared.privacy.prg import SEED_BYTES, Keystream

__all__ = ["MAX_VARIANCE", "DiscreteGaussian", "conditional_round", "squared_norm_within", "squares_within"]

_BITS = 53  # the bits of U the vectorised path reads: exact in float64
_REL = 2.0**-40  # certified relative error of -t ln U and of gamma in float64 (libm's log is within 2^-52)
_WINDOW = 1 << 20  # samples drawn per step
_ROUNDING_TRIES = 8
T = TypeVar("T")
MAX_VARIANCE = 2**80  # the largest variance sampled, in grid steps squared: every value stays far inside int64


class _LazyUniform:
    """U uniform on [0, 1): its first bits known, more drawn 64 at a time when a decision needs them."""

    def __init__(self, prefix: int, bits: int, stream: Keystream) -> None:
        self.prefix, self.bits, self._stream = prefix, bits, stream

    def refine(self) -> None:
        """Draw 64 more bits of U: its interval shrinks 2^64-fold."""
        self.prefix = (self.prefix << 64) | int(self._stream.uint64(1)[0])
        self.bits += 64

    def neg_log_bounds(self, digits: int) -> tuple[Fraction, Fraction | None]:
        """(lo, hi) with lo <= -ln U <= hi for every U of the current interval; hi None where it starts at 0."""
        context = Context(prec=digits)
        slack = Fraction(1, 10 ** (digits - 3))  # a generous bound on both roundings, relative to 1 + |-ln U|
        low_end, high_end = Fraction(self.prefix, 1 << self.bits), Fraction(self.prefix + 1, 1 << self.bits)
        lo = _neg_ln(high_end, context)
        lo -= slack * (1 + abs(lo))
        if low_end == 0:
            return lo, None
        hi = _neg_ln(low_end, context)
        return lo, hi + slack * (1 + abs(hi))

    def settle(self, decide: Callable[[Fraction, Fraction | None], T | None]) -> T:
        """decide(lo, hi) on bounds of -ln U at growing precision and with more bits, until it answers."""
        digits = 40
        while (answer := decide(*self.neg_log_bounds(digits))) is None:
            self.refine()
            digits += 25
        return answer


def _floor_scaled(scale: int) -> Callable[[Fraction, Fraction | None], int | None]:
    """floor(scale * -ln U) once both bounds agree on it."""
    return lambda lo, hi: (
        math.floor(scale * lo) if hi is not None and math.floor(scale * lo) == math.floor(scale * hi) else None
    )


def _exceeds(threshold: Fraction) -> Callable[[Fraction, Fraction | None], bool | None]:
    """Whether -ln U > threshold (U < exp(-threshold)), once the bounds lie on one side of it."""
    return lambda lo, hi: True if lo > threshold else False if hi is not None and hi <= threshold else None


def _neg_ln(value: Fraction, context: Context) -> Fraction:
    """-ln(value) at the context's precision, as an exact fraction of the decimal result."""
    decimal = context.divide(Decimal(value.numerator), Decimal(value.denominator))
    return -Fraction(decimal.ln(context))


class DiscreteGaussian:
    """Exact samples of the discrete Gaussian N_Z(0, s2) (see the module); the key comes from the OS unless given."""

    def __init__(self, key: bytes | None = None) -> None:
        self._stream = Keystream(key if key is not None else secrets.token_bytes(SEED_BYTES))

    def sample(self, size: int, variance: Fraction) -> np.ndarray:
        """`size` independent draws of N_Z(0, variance) as int64; variance 0 gives zeros."""
        if variance < 0:
            raise PrivacyInputError(f"a variance is not negative, got {variance}")
        out = np.zeros(size, dtype=np.int64)
        if variance == 0:
            return out
        if variance > MAX_VARIANCE:
            raise PrivacyInputError(f"a variance of {float(variance):.3g} grid steps squared exceeds 2^80")
        for start in range(0, size, _WINDOW):
            stop = min(size, start + _WINDOW)
            out[start:stop] = self._window(stop - start, Fraction(variance))
        return out

    def _window(self, size: int, variance: Fraction) -> np.ndarray:
        scale = math.isqrt(variance.numerator // variance.denominator) + 1  # t = floor(sigma) + 1
        out = np.empty(size, dtype=np.int64)
        pending = np.arange(size)
        while pending.size:
            candidate, valid = self._laplace(pending.size, scale)
            kept = valid & self._keep(candidate, scale, variance)
            out[pending[kept]] = candidate[kept]
            pending = pending[~kept]
        return out

    def words32(self, size: int) -> np.ndarray:
        """`size` fresh uniform uint32 words of the stream: the bits of randomized rounding."""
        return self._stream.fill(np.empty(size, dtype=np.uint32))

    def _uniform_words(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(A, b) of `size` fresh words: U in [A, A + 1) / 2^53 from the top 53 bits, and an independent low bit b."""
        words = self._stream.uint64(size)
        return (words >> np.uint64(64 - _BITS)).astype(np.int64), (words & np.uint64(1)).astype(bool)

    def _uniform_prefixes(self, size: int) -> np.ndarray:
        """The first 53 bits of `size` fresh uniforms U, as integers A with U in [A, A + 1) / 2^53."""
        return self._uniform_words(size)[0]

    def _neg_log(self, prefixes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Float64 (lo, hi) around -ln U over each U's interval [a, a + 2^-53), before the certified margin.

        hi = -ln a; lo = hi - 1/A <= -ln(a + 2^-53), since ln(1 + x) <= x: one logarithm per uniform.
        """
        with np.errstate(divide="ignore"):
            hi = -np.log(prefixes.astype(np.float64) * 2.0**-_BITS)  # inf where the interval starts at 0
        lo = np.where(prefixes == 0, _BITS * math.log(2), hi - 1.0 / np.maximum(prefixes, 1))
        return lo, hi

    def _geometric(self, prefixes: np.ndarray, scale: int) -> np.ndarray:
        """G = floor(scale * -ln U) of each uniform, so P(G >= k) = exp(-k / scale), exactly."""
        lo, hi = self._neg_log(prefixes)
        low = np.floor(lo * scale * (1 - _REL))
        high = np.floor(hi * scale * (1 + _REL))
        values = low.astype(np.int64)
        for index in np.flatnonzero(low != high):
            values[index] = _LazyUniform(int(prefixes[index]), _BITS, self._stream).settle(_floor_scaled(scale))
        return values

    def _laplace(self, size: int, scale: int) -> tuple[np.ndarray, np.ndarray]:
        """(Y, valid): the discrete Laplace, P(y) proportional to exp(-|y| / scale), where `valid`.

        Y = (1 - 2B) G with G geometric and B a fair bit, a negative zero discarded (not valid), so
        every y has probability proportional to exp(-|y| / scale), zero included once.
        """
        prefixes, sign = self._uniform_words(size)
        magnitude = self._geometric(prefixes, scale)
        return np.where(sign, -magnitude, magnitude), ~(sign & (magnitude == 0))

    def _keep(self, candidate: np.ndarray, scale: int, variance: Fraction) -> np.ndarray:
        """Keep each candidate Y with probability exp(-gamma), gamma = (|Y| - s2 / t)^2 / (2 s2)."""
        magnitude = np.abs(candidate)
        variance_float = float(variance)
        gamma = np.square(magnitude - variance_float / scale) / (2 * variance_float)
        prefixes = self._uniform_prefixes(candidate.size)
        lo, hi = self._neg_log(prefixes)
        margin = _REL * (1 + gamma)
        keep: np.ndarray = lo * (1 - _REL) > gamma + margin
        drop = hi * (1 + _REL) < gamma - margin
        for index in np.flatnonzero(~(keep | drop)):
            exact = (int(magnitude[index]) * scale - variance) ** 2 / (2 * variance * scale**2)
            keep[index] = _LazyUniform(int(prefixes[index]), _BITS, self._stream).settle(_exceeds(exact))
        return keep


def squared_norm_within(values: np.ndarray, bound_squared: Fraction) -> bool:
    """Whether the integer vector `values` has ||values||^2 <= bound_squared, certified.

    Below 2^53 the float64 sum of integer squares is exact; above, it errs by far less than a
    relative 2^-40 (pairwise summation), which the comparison leaves as margin. A vector that passes
    is within the bound, exactly.
    """
    return squares_within(float(np.square(values.astype(np.float64)).sum()), bound_squared)


def squares_within(total: float, bound_squared: Fraction) -> bool:
    """Whether a float64 sum of integer squares is certainly at most `bound_squared` (see squared_norm_within)."""
    return (total if total <= 2.0**53 else total * (1 + 2.0**-40)) <= bound_squared


def conditional_round(values: np.ndarray, bound_squared: Fraction, source: DiscreteGaussian) -> np.ndarray:
    """`values` (float64, grid units) rounded to integers: randomized rounding kept within the norm bound.

    Each value becomes floor(x) + 1 with probability x - floor(x) (to 2^-32), else floor(x), drawn
    again while the rounded vector's squared norm exceeds `bound_squared`; after a few tries the
    nearest integers are taken, which stay within the bound whenever ||values|| + sqrt(d) / 2 does.
    A vector that still exceeds it is refused (its caller clips before rounding).
    """
    floor = np.floor(values)
    threshold = (values - floor) * 2.0**32  # round up when a uniform 32-bit word falls below it
    base = floor.astype(np.int64)
    for _ in range(_ROUNDING_TRIES):
        rounded: np.ndarray = base + (source.words32(values.size) < threshold)
        if squared_norm_within(rounded, bound_squared):
            return rounded
    nearest: np.ndarray = np.rint(values).astype(np.int64)
    if not squared_norm_within(nearest, bound_squared):
        raise PrivacyInputError(f"a vector of norm {float(np.linalg.norm(values)):.6g} exceeds the rounding bound")
    return nearest
