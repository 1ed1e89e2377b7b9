"""How a site agent's process holds model-sized memory: freed blocks kept for the next round, returned when idle.

Each round the agent allocates θ^g's download buffer and its update's body, as large as the model,
and frees them. glibc's malloc gives a block above 32 MiB pages of its own, returned when it is
freed, so every round takes its buffers' pages from the system again: a page fault for each 4 KiB,
which the kernel also zero-fills. Measured on the paper model (94 MB) with four echo agents
(bench/round_overhead.py): a quarter of the agents' CPU went to page faults, and the agents used
2.7 s of CPU a round with glibc's thresholds against 2.0 s with these.
"""

from __future__ import annotations

import logging

from shared.heap import trim_heap, tune_heap

__all__ = ["KEPT_BLOCK_BYTES", "hand_back_idle_memory", "keep_model_buffers"]

log = logging.getLogger(__name__)

KEPT_BLOCK_BYTES = 128 << 20  # blocks below this come from the heap and are reused; larger ones as glibc does
KEPT_FREE_BYTES = 4 * KEPT_BLOCK_BYTES  # free heap kept at its top between rounds (a model's buffers)


def keep_model_buffers() -> bool:
    """Serve blocks below KEPT_BLOCK_BYTES from malloc's heap and keep what a round frees for the next one.

    Blocks above KEPT_BLOCK_BYTES are handled as glibc does by default: a big model's memory bound
    matters more than the faults, which its transfers dwarf. With 256 MiB, the 1 GB model of
    bench/big_round.py (tensors of about 250 MB) trained on the heap, and its holes raised the
    agents' peak to 4.3-4.8 x theta^g against a bound of 4 (3.1 before). Whether glibc took the settings.
    """
    kept = tune_heap(mmap_threshold=KEPT_BLOCK_BYTES, trim_threshold=KEPT_FREE_BYTES)
    if not kept:
        log.debug("malloc keeps its own thresholds (not glibc, or a setting was refused)")
    return kept


def hand_back_idle_memory() -> bool:
    """Return the heap's free pages to the system while the agent has no task; whether it could (glibc)."""
    return trim_heap()
