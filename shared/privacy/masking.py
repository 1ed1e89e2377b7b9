"""Masks in the ring Z_{2^64}: a self mask PRG(b_u) plus pairwise masks +-PRG(s_uv) that cancel in the sum.

Site u adds +PRG(s_uv) for each partner v > u and subtracts it for each v < u, so over any set of
sites that includes both ends of every pair the pairwise masks cancel (Bonawitz et al., CCS 2017,
§3). uint64 arithmetic wraps modulo 2^64, which is exactly the ring; masked words are uniform and
independent of the input as long as one mask term is unknown.

Every mask of a vector is applied one window at a time (`MaskStreams`, `apply_masks`): each stream writes its
next window into one small scratch buffer that stays in the CPU cache, instead of a full-length
keystream per mask, so masking costs about the keystream's generation alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from shared.errors import PrivacyInputError
from shared.privacy.prg import Keystream

__all__ = ["WINDOW", "MaskStreams", "SignedSeed", "apply_masks", "mask_vector", "pairwise_sign"]

SignedSeed = tuple[bytes, int]  # a mask's seed, and +1 to add PRG(seed) or -1 to subtract it
WINDOW = 1 << 16  # ring elements per window: 512 KiB of keystream scratch, which stays in the CPU cache


def pairwise_sign(site: int, peer: int) -> int:
    """+1 if `site` adds the mask it shares with `peer` (site < peer), -1 if it subtracts it."""
    if site == peer:
        raise PrivacyInputError("a site has no pairwise mask with itself")
    return 1 if site < peer else -1


class MaskStreams:
    """The keystreams of a vector's masks, applied to it one window after another, from its first element on."""

    def __init__(self, masks: Sequence[SignedSeed]) -> None:
        if any(sign not in (1, -1) for _, sign in masks):
            raise PrivacyInputError("a mask's sign is +1 or -1")
        self._streams = [(Keystream(seed), np.add if sign > 0 else np.subtract) for seed, sign in masks]
        self._scratch = np.empty(0, dtype=np.uint64)

    def apply(self, window: np.ndarray) -> None:
        """Add or subtract the next `window.size` words of every mask to the contiguous uint64 `window`, in place."""
        if window.dtype != np.uint64 or window.ndim != 1 or not window.flags.c_contiguous:
            raise PrivacyInputError(f"masks apply to contiguous 1-D uint64 windows, got {window.dtype} {window.shape}")
        if self._scratch.size < window.size:
            self._scratch = np.empty(window.size, dtype=np.uint64)
        keystream = self._scratch[: window.size]
        for stream, combine in self._streams:
            combine(window, stream.fill(keystream), out=window)


def apply_masks(total: np.ndarray, masks: Sequence[SignedSeed]) -> np.ndarray:
    """Add (+1) or subtract (-1) PRG(seed) for every (seed, sign) of `masks` to `total` in Z_{2^64}, in place."""
    streams = MaskStreams(masks)
    if total.ndim != 1:
        raise PrivacyInputError(f"masks apply to 1-D uint64 ring vectors, got shape {total.shape}")
    for start in range(0, total.size, WINDOW):
        streams.apply(total[start : start + WINDOW])
    return total


def mask_vector(
    ring_vector: np.ndarray,
    *,
    site: int,
    self_mask_seed: bytes,
    pairwise_seeds: Mapping[int, bytes],
    in_place: bool = False,
) -> np.ndarray:
    """`ring_vector` + PRG(b_u) + sum over partners v of sign(u, v) * PRG(s_uv): a copy, or in place."""
    if ring_vector.dtype != np.uint64 or ring_vector.ndim != 1:
        raise PrivacyInputError(
            f"masking works on 1-D uint64 ring vectors, got {ring_vector.dtype} {ring_vector.shape}"
        )
    masks = [(self_mask_seed, 1)] + [(seed, pairwise_sign(site, peer)) for peer, seed in sorted(pairwise_seeds.items())]
    return apply_masks(ring_vector if in_place else ring_vector.copy(), masks)
