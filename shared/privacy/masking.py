"""Masks in Z_{2^32} and Z_{2^64}: a self mask PRG(b_u) plus pairwise masks +-PRG(s_uv) that cancel in the sum.

Site u adds +PRG(s_uv) for each partner v > u and subtracts it for each v < u, so over any set of
sites that includes both ends of every pair the pairwise masks cancel (Bonawitz et al., CCS 2017,
§3). A ring vector is one uint32 or uint64 array, or a sequence of them (sections, e.g. the model's
words in Z_{2^32} and the statistics in Z_{2^64}); each mask's keystream runs on through the
sections in order, its next 4 or 8 bytes read as the next word. Unsigned arithmetic wraps modulo
2^32 or 2^64, which is exactly each section's ring; masked words are uniform and independent of
the input as long as one mask term is unknown.

Every mask of a vector is applied one window at a time (`MaskStreams`, `apply_masks`): each stream writes its
next window into one small scratch buffer that stays in the CPU cache, instead of a full-length
keystream per mask, so masking costs about the keystream's generation alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from shared.errors import PrivacyInputError
from shared.privacy.prg import Keystream

__all__ = [
    "WINDOW",
    "MaskStreams",
    "RingVector",
    "SignedSeed",
    "apply_masks",
    "mask_vector",
    "pairwise_sign",
    "ring_sections",
    "ring_shape",
    "sum_rings",
]

SignedSeed = tuple[bytes, int]  # a mask's seed, and +1 to add PRG(seed) or -1 to subtract it
RingVector = np.ndarray | Sequence[np.ndarray]  # one uint32/uint64 array, or its sections in order
WINDOW = 1 << 16  # ring elements per window: at most 512 KiB of keystream scratch, which stays in the CPU cache
_RINGS = (np.dtype(np.uint32), np.dtype(np.uint64))


def ring_sections(vector: RingVector) -> list[np.ndarray]:
    """The sections of a ring vector, each checked to be a contiguous 1-D uint32 or uint64 array."""
    sections = [vector] if isinstance(vector, np.ndarray) else list(vector)
    for section in sections:
        if section.dtype not in _RINGS or section.ndim != 1 or not section.flags.c_contiguous:
            raise PrivacyInputError(
                f"ring vectors are contiguous 1-D uint32 or uint64 arrays, got {section.dtype} {section.shape}"
            )
    return sections


def ring_shape(vector: RingVector) -> list[tuple[str, int]]:
    """(dtype name, length) of each section of a ring vector, in order."""
    return [(section.dtype.name, section.size) for section in ring_sections(vector)]


def sum_rings(vectors: Iterable[RingVector]) -> RingVector:
    """The sum of ring vectors of one shape, each section in its ring (a new vector, of the first one's form)."""
    iterator = iter(vectors)
    first = next(iterator, None)
    if first is None:
        raise PrivacyInputError("no ring vector to sum")
    totals = [section.copy() for section in ring_sections(first)]
    for vector in iterator:
        if ring_shape(vector) != ring_shape(totals):
            raise PrivacyInputError("ring vectors of different sections cannot be summed")
        for total, section in zip(totals, ring_sections(vector), strict=True):
            np.add(total, section, out=total)
    return totals[0] if isinstance(first, np.ndarray) else tuple(totals)


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
        """Add or subtract every mask's next `window.nbytes` bytes, as words of `window`'s ring, to it in place."""
        (window,) = ring_sections(window)
        if self._scratch.nbytes < window.nbytes:
            self._scratch = np.empty(-(-window.nbytes // 8), dtype=np.uint64)
        keystream = self._scratch.view(window.dtype)[: window.size]
        for stream, combine in self._streams:
            combine(window, stream.fill(keystream), out=window)


def apply_masks(total: RingVector, masks: Sequence[SignedSeed]) -> RingVector:
    """Add (+1) or subtract (-1) PRG(seed) for every (seed, sign) of `masks` to `total`'s sections, in place."""
    streams = MaskStreams(masks)
    for section in ring_sections(total):
        for start in range(0, section.size, WINDOW):
            streams.apply(section[start : start + WINDOW])
    return total


def mask_vector(
    ring_vector: RingVector,
    *,
    site: int,
    self_mask_seed: bytes,
    pairwise_seeds: Mapping[int, bytes],
    in_place: bool = False,
) -> RingVector:
    """`ring_vector` + PRG(b_u) + sum over partners v of sign(u, v) * PRG(s_uv): a copy, or in place."""
    sections = ring_sections(ring_vector)
    if not in_place:
        copies = [section.copy() for section in sections]
        ring_vector = copies[0] if isinstance(ring_vector, np.ndarray) else tuple(copies)
    masks = [(self_mask_seed, 1)] + [(seed, pairwise_sign(site, peer)) for peer, seed in sorted(pairwise_seeds.items())]
    return apply_masks(ring_vector, masks)
