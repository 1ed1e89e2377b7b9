"""Flat buffers for sums, kept between averages so that each round's sums cost no fresh page faults."""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

__all__ = ["KEEP", "MIN_BYTES", "SumBuffers", "sum_buffers"]

KEEP = 4  # free buffers kept (a Scaffold round holds two models' worth of sums at once)
MIN_BYTES = 1 << 20  # smaller buffers come cheaply from the heap and are not kept


class SumBuffers:
    """Hands out flat buffers, and takes back those of an owner once it is garbage.

    A fresh model-sized buffer costs the kernel a page fault per 4 KiB when first written, about
    as long as summing an update into it; a coordinator averages the same model every round, so
    the buffers of one round serve the next. At most `keep` free buffers are kept, the most
    recently returned first, so what is held stays a few models whatever the number of sites.
    """

    def __init__(self, keep: int = KEEP, min_bytes: int = MIN_BYTES) -> None:
        self.keep, self.min_bytes = keep, min_bytes
        self._free: list[Tensor] = []
        self._lock = threading.Lock()

    def take(self, owner: object, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of `numel` elements of `dtype` (contents undefined), returned when `owner` is garbage."""
        buffer = self._reuse(numel, dtype)
        if buffer is None:
            buffer = torch.empty(numel, dtype=dtype)
        if buffer.numel() * buffer.element_size() >= self.min_bytes:
            weakref.finalize(owner, self._give, buffer)
        return buffer

    def held_bytes(self) -> int:
        """Bytes of the free buffers kept now."""
        with self._lock:
            return sum(buffer.numel() * buffer.element_size() for buffer in self._free)

    def _reuse(self, numel: int, dtype: torch.dtype) -> Tensor | None:
        with self._lock:
            for index in range(len(self._free) - 1, -1, -1):
                if self._free[index].numel() == numel and self._free[index].dtype == dtype:
                    return self._free.pop(index)
        return None

    def _give(self, buffer: Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            del self._free[: -self.keep or len(self._free)]


sum_buffers = SumBuffers()  # the process's buffers, shared by every average
