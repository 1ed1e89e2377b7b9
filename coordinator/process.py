"""How the coordinator's server process runs: one torch thread, and a heap that does not grow with K."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["bound_heap_growth", "configure_server_process"]

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 16 << 20


def configure_server_process() -> None:
    """Settings for a process that serves the coordinator (called once, before the app is built).

    Its tensor work (checking uploads, averaging) is memory-bound and runs beside request threads
    and other processes: one torch intra-op thread is faster than two contending ones.
    """
    import torch

    torch.set_num_threads(1)
    bound_heap_growth()


def bound_heap_growth() -> bool:
    """Tell glibc's malloc to return large blocks to the system and to keep few per-thread arenas.

    Request threads allocate and free megabyte-sized buffers (chunks of uploads and downloads); by
    default each thread gets an arena of its own that keeps what it freed, so resident memory grows
    with the number of concurrent transfers. Two arenas serve every thread here, and a fixed 16 MiB
    mmap threshold (instead of one that rises with what was freed) returns every model-sized block
    to the system when freed. Returns False where the C library is not glibc.
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
