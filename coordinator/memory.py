"""Keep the coordinator's heap from growing with the number of concurrent requests (glibc's malloc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["bound_heap_growth"]

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 1 << 20


def bound_heap_growth() -> bool:
    """Tell glibc's malloc to return large blocks to the system and to keep few per-thread arenas.

    Request threads allocate and free megabyte-sized buffers (chunks of uploads and downloads); by
    default each thread gets an arena that keeps what it freed, and a blocks' size that was once
    freed raises the size served from those arenas, so resident memory grows with the number of
    concurrent transfers. With a fixed 1 MiB mmap threshold such blocks go back to the system when
    freed, and two arenas serve every thread. Returns False where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_ARENA_MAX, 2))
    if not applied:
        log.info("mallopt refused the heap settings; memory may grow with concurrent transfers")
    return applied
