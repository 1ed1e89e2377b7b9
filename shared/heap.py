"""glibc's malloc told how to hold large blocks (mallopt, malloc_trim); a no-op where the C library is another."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["tune_heap", "trim_heap"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt and malloc_trim); None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def tune_heap(*, mmap_threshold: int, trim_threshold: int, arenas: int | None = None) -> bool:
    """Set malloc's thresholds (and arena count); whether every setting was taken (False where not glibc).

    Blocks of `mmap_threshold` bytes and more get pages of their own, returned when freed (a fixed
    threshold replaces glibc's dynamic one, which rises with the blocks freed); free heap above
    `trim_threshold` at its top goes back to the system when a block is freed; at most `arenas`
    per-thread heaps (None: glibc's own count).
    """
    libc = _glibc()
    if libc is None:
        return False
    settings = [(_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold)]
    if arenas is not None:
        settings.append((_M_ARENA_MAX, arenas))
    taken = [libc.mallopt(option, value) for option, value in settings]  # every one applied, then judged
    return all(taken)


def trim_heap() -> bool:
    """Hand malloc's free pages back to the system (malloc_trim walks every free block); whether it could."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
