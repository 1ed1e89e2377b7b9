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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.privacy.errors import ValueOutOfRange

__all__ = ["COUNTS", "FixedPoint"]


@dataclass(frozen=True)
class FixedPoint:
    """Encoding with `fraction_bits` bits after the binary point, safe for sums of up to `max_sites` vectors."""

    fraction_bits: int = 24
    max_sites: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.fraction_bits <= 52:
            raise ValueError(f"fraction_bits must lie in [0, 52], got {self.fraction_bits}")
        if not 1 <= self.max_sites <= 2**30:
            raise ValueError(f"max_sites must lie in [1, 2^30], got {self.max_sites}")

    @property
    def scale(self) -> float:
        """The factor 2^f between a value and its integer code."""
        return float(2**self.fraction_bits)

    @property
    def max_abs(self) -> float:
        """The largest |value| one site may encode: 2^(62 - f) / max_sites."""
        return 2.0 ** (62 - self.fraction_bits) / self.max_sites

    def error_bound(self, sites: int) -> float:
        """The largest error per coordinate of a decoded sum of `sites` encoded vectors: sites * 2^-(f+1)."""
        return 0.0 if self.fraction_bits == 0 else sites * 2.0 ** -(self.fraction_bits + 1)

    def encode(self, values: np.ndarray) -> np.ndarray:
        """Round `values * 2^f` to the nearest integer, as two's complement uint64; refuse out-of-range values."""
        work = np.array(values, dtype=np.float64, copy=True).reshape(-1)
        if work.size:
            low, high = float(work.min()), float(work.max())  # NaN makes both comparisons below fail
            if not (-self.max_abs <= low and high <= self.max_abs):
                raise ValueOutOfRange(f"values in [{low:.6g}, {high:.6g}] are not finite or exceed {self.max_abs:.6g}")
        np.multiply(work, self.scale, out=work)  # exact: a power of two
        np.rint(work, out=work)
        return work.astype(np.int64).view(np.uint64).reshape(np.shape(values))

    def decode(self, ring_sum: np.ndarray) -> np.ndarray:
        """Read a ring sum back as float64 values (two's complement, divided by 2^f)."""
        return np.asarray(ring_sum, dtype=np.uint64).view(np.int64).astype(np.float64) / self.scale

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
            raise ValueError("integer statistics are encoded with fraction_bits=0 (see COUNTS)")


COUNTS = FixedPoint(fraction_bits=0)  # scale 1: counts and histograms, summed exactly
