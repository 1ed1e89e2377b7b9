"""Fixed-point encoding of real and integer vectors into the ring Z_{2^64}, where masks are added.

A value x becomes q = round(x * 2^f) (round half to even, |error| <= 2^-(f+1)), stored as the
two's complement of q in a uint64. Ring addition of such words is exact integer addition as long
as the true sum stays in [-2^63, 2^63); decoding reads the sum back as int64 and divides by 2^f.

Range: every encoded |x| must be at most `max_abs = 2^(62 - f) / max_sites`, so the sum of up to
`max_sites` encodings has |sum| <= 2^62 (half the signed range: one bit of headroom). The
defaults f = 24, max_sites = 1024 give max_abs = 2^28 ~ 2.7e8 and a decoded sum of K sites whose
error per coordinate is at most K * 2^-25 ~ K * 3.0e-8. Values outside the range are refused, not
clipped: a silently clipped weight would be a wrong model. Integer statistics (counts,
histograms) use f = 0 and are then exact.

`ring_bits=32` encodes into Z_{2^32} (uint32 words, half the bytes) for values that are summed
with factors w_k >= 0 whose sum over the sites is at most 1 (normalised aggregation weights): then
|sum_k w_k x_k| <= max_k |x_k|, so each site checks its own values, before the factor, against
`max_abs = 2^(30 - f)` (one bit of headroom for the rounding of K sites, up to 2^30 of them), and
the factor must lie in [0, 1]. With f = 24 that is |x| <= 64 at the same resolution 2^-24: the
model's change in a round, not the model itself (shared/study/secagg.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import PrivacyInputError
from shared.privacy.errors import ValueOutOfRange

__all__ = ["COUNTS", "FixedPoint"]

_WINDOW = 1 << 16  # values encoded per step: the float64 scratch stays in the CPU cache


@dataclass(frozen=True)
class FixedPoint:
    """Encoding with `fraction_bits` bits after the binary point, safe for sums of up to `max_sites` vectors."""

    fraction_bits: int = 24
    max_sites: int = 1024
    ring_bits: int = 64  # 32: Z_{2^32}, for sums with factors in [0, 1] summing to at most 1 (see above)

    def __post_init__(self) -> None:
        if self.ring_bits not in (32, 64):
            raise PrivacyInputError(f"ring_bits is 32 or 64, got {self.ring_bits}")
        if not 0 <= self.fraction_bits <= (52 if self.ring_bits == 64 else 28):
            raise PrivacyInputError(f"fraction_bits {self.fraction_bits} does not fit a {self.ring_bits}-bit ring")
        if not 1 <= self.max_sites <= 2**30:
            raise PrivacyInputError(f"max_sites must lie in [1, 2^30], got {self.max_sites}")

    @property
    def word(self) -> np.dtype:
        """The ring's words: uint64 or uint32."""
        return np.dtype(np.uint64 if self.ring_bits == 64 else np.uint32)

    @property
    def scale(self) -> float:
        """The factor 2^f between a value and its integer code."""
        return float(2**self.fraction_bits)

    @property
    def max_abs(self) -> float:
        """The largest |value| a site may encode: 2^(62 - f) / max_sites; in Z_{2^32} 2^(30 - f), before the factor."""
        if self.ring_bits == 32:
            return 2.0 ** (30 - self.fraction_bits)
        return 2.0 ** (62 - self.fraction_bits) / self.max_sites

    def error_bound(self, sites: int) -> float:
        """The largest error per coordinate of a decoded sum of `sites` encoded vectors: sites * 2^-(f+1)."""
        return 0.0 if self.fraction_bits == 0 else sites * 2.0 ** -(self.fraction_bits + 1)

    def encode(self, values: np.ndarray) -> np.ndarray:
        """Round `values * 2^f` to the nearest integer, as two's complement ring words; refuse out-of-range values."""
        flat = np.asarray(values).reshape(-1)
        return self.encode_into(flat, np.empty(flat.size, dtype=self.word)).reshape(np.shape(values))

    def encode_into(
        self, values: np.ndarray, out: np.ndarray, factor: float | np.ndarray = 1.0, base: np.ndarray | None = None
    ) -> np.ndarray:
        """Write the codes of `(values - base) * factor` (1-D, any real or integer dtype) into the ring words `out`.

        `factor` is one number or one per value; `base` (optional) is subtracted first. Works a window
        at a time in float64: (x - base) * factor * 2^f, scaling by a power of two being exact, so the
        codes equal `encode((values - base) * factor)` bit for bit. Returns `out`.
        """
        if values.ndim != 1 or out.shape != values.shape or out.dtype != self.word:
            raise PrivacyInputError(
                f"encode_into needs a 1-D input and a {self.word} output of its shape, got {out.dtype} {out.shape}"
            )
        per_value = np.ndim(factor) > 0
        factors = np.asarray(factor)
        if per_value and factors.shape != values.shape or base is not None and base.shape != values.shape:
            raise PrivacyInputError(f"{np.shape(factor)} factors or a base for {values.shape} values")
        narrow = self.ring_bits == 32  # the bound holds for the values before the factor, which lies in [0, 1]
        if narrow and not (0.0 <= float(factors.min(initial=0.0)) and float(factors.max(initial=0.0)) <= 1.0):
            raise ValueOutOfRange("factors in Z_{2^32} lie in [0, 1]")
        scale = self.scale if per_value else float(factor) * self.scale
        work = np.empty(min(_WINDOW, values.size), dtype=np.float64)
        codes = out.view(np.int32 if narrow else np.int64)
        for start in range(0, values.size, _WINDOW):
            chunk = work[: min(_WINDOW, values.size - start)]
            chunk[...] = values[start : start + chunk.size]  # to float64 first, then scale in float64
            if base is not None:
                np.subtract(chunk, base[start : start + chunk.size], out=chunk)
            if narrow:
                self._check(chunk, 1.0)
            if per_value:
                np.multiply(chunk, factors[start : start + chunk.size], out=chunk)
            np.multiply(chunk, scale, out=chunk)
            if not narrow:
                self._check(chunk, self.scale)
            np.rint(chunk, out=chunk)
            codes[start : start + chunk.size] = chunk
        return out

    def _check(self, chunk: np.ndarray, unit: float) -> None:
        """ValueOutOfRange unless every value of `chunk` (in units of 1 / `unit`) is finite and within max_abs."""
        low, high, limit = float(chunk.min()) / unit, float(chunk.max()) / unit, self.max_abs
        if not (-limit <= low and high <= limit):  # NaN makes both comparisons fail
            raise ValueOutOfRange(f"values in [{low:.6g}, {high:.6g}] are not finite or exceed {limit:.6g}")

    def decode(self, ring_sum: np.ndarray) -> np.ndarray:
        """Read a ring sum back as float64 values (two's complement, divided by 2^f)."""
        signed = np.int64 if self.ring_bits == 64 else np.int32
        values = np.asarray(ring_sum, dtype=self.word).view(signed).astype(np.float64)
        values /= self.scale  # in place: one float64 array, not two
        return values

    def encode_counts(self, counts: np.ndarray) -> np.ndarray:
        """Encode integer statistics exactly (requires fraction_bits = 0); refuse out-of-range counts."""
        self._require_integers()
        counts = np.asarray(counts)
        if not np.issubdtype(counts.dtype, np.integer):
            raise ValueOutOfRange(f"counts must be integers, got {counts.dtype}")
        if counts.size and int(np.abs(counts.astype(np.int64)).max()) > self.max_abs:
            raise ValueOutOfRange(f"a count exceeds {self.max_abs:.6g}")
        return counts.astype(np.int64).view(np.uint64)

    def decode_counts(self, ring_sum: np.ndarray) -> np.ndarray:
        """Read a ring sum of integer statistics back as int64 (requires fraction_bits = 0)."""
        self._require_integers()
        return np.asarray(ring_sum, dtype=np.uint64).view(np.int64).copy()

    def _require_integers(self) -> None:
        if self.fraction_bits != 0:
            raise PrivacyInputError("integer statistics are encoded with fraction_bits=0 (see COUNTS)")


COUNTS = FixedPoint(fraction_bits=0)  # scale 1: counts and histograms, summed exactly
