"""Masks in the ring Z_{2^64}: a self mask PRG(b_u) plus pairwise masks +-PRG(s_uv) that cancel in the sum.

Site u adds +PRG(s_uv) for each partner v > u and subtracts it for each v < u, so over any set of
sites that includes both ends of every pair the pairwise masks cancel (Bonawitz et al., CCS 2017,
§3). uint64 arithmetic wraps modulo 2^64, which is exactly the ring; masked words are uniform and
independent of the input as long as one mask term is unknown.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.privacy.prg import Keystream

__all__ = ["add_stream", "mask_vector", "pairwise_sign", "subtract_stream"]


def pairwise_sign(site: int, peer: int) -> int:
    """+1 if `site` adds the mask it shares with `peer` (site < peer), -1 if it subtracts it."""
    if site == peer:
        raise ValueError("a site has no pairwise mask with itself")
    return 1 if site < peer else -1


def add_stream(total: np.ndarray, seed: bytes, scratch: np.ndarray | None = None) -> None:
    """Add PRG(seed) to `total` in Z_{2^64}, in place; `scratch` (same size) saves an allocation."""
    np.add(total, _stream(seed, total, scratch), out=total)


def subtract_stream(total: np.ndarray, seed: bytes, scratch: np.ndarray | None = None) -> None:
    """Subtract PRG(seed) from `total` in Z_{2^64}, in place; `scratch` (same size) saves an allocation."""
    np.subtract(total, _stream(seed, total, scratch), out=total)


def mask_vector(
    ring_vector: np.ndarray, *, site: int, self_mask_seed: bytes, pairwise_seeds: Mapping[int, bytes]
) -> np.ndarray:
    """A masked copy of `ring_vector`: + PRG(b_u) + sum over partners v of sign(u, v) * PRG(s_uv)."""
    if ring_vector.dtype != np.uint64 or ring_vector.ndim != 1:
        raise ValueError(f"masking works on 1-D uint64 ring vectors, got {ring_vector.dtype} {ring_vector.shape}")
    masked = ring_vector.copy()
    scratch = np.empty_like(masked)
    add_stream(masked, self_mask_seed, scratch)
    for peer, seed in sorted(pairwise_seeds.items()):
        if pairwise_sign(site, peer) > 0:
            add_stream(masked, seed, scratch)
        else:
            subtract_stream(masked, seed, scratch)
    return masked


def _stream(seed: bytes, like: np.ndarray, scratch: np.ndarray | None) -> np.ndarray:
    buffer = scratch if scratch is not None else np.empty_like(like)
    if buffer.shape != like.shape:
        raise ValueError(f"scratch of shape {buffer.shape} does not match {like.shape}")
    return Keystream(seed).fill(buffer)
