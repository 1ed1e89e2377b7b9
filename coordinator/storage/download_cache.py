"""Blobs being downloaded, kept whole in memory: every site of a round downloads the same global model."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from sqlalchemy import Engine

from coordinator.storage.blob_parts import Buffer
from coordinator.storage.blobs import read_range

__all__ = ["BlobCache"]


class BlobCache:
    """Whole blobs up to `budget_bytes` in all, least recently used out first; one reader fills each.

    A blob is read from the database once, front to back (the cheapest way: a blob stored across
    many pages is slow to enter in the middle), and then served to every site from memory, so K
    downloads cost one read and the memory of one copy however large K is.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._blobs: OrderedDict[str, Buffer] = OrderedDict()
        self._loading: dict[str, threading.Lock] = {}

    def get(self, engine: Engine, digest: str, size: int) -> Buffer | None:
        """Blob `digest` (of `size` bytes), read now if it is not held; None when it exceeds the budget."""
        if size > self.budget_bytes:
            return None
        with self._lock:
            if (data := self._held(digest)) is not None:
                return data
            loading = self._loading.setdefault(digest, threading.Lock())
        with loading:  # concurrent first downloads of one blob: one reads, the others wait for it
            with self._lock:
                if (data := self._held(digest)) is not None:
                    return data
            data = read_range(engine, digest, 0, size)
            with self._lock:
                self._hold(digest, data)
                self._loading.pop(digest, None)
        return data

    def offer(self, digest: str, pieces: Sequence[Buffer]) -> None:
        """Hold blob `digest`, whose bytes are `pieces` in memory now (a global model being stored), if it fits.

        The round that stores theta^g_t has its bytes at hand: held now, the K downloads that follow
        read nothing back from the database. One piece is held as it is, not copied: the caller
        must never change it.
        """
        size = sum(memoryview(piece).nbytes for piece in pieces)
        if size > self.budget_bytes:
            return
        with self._lock:
            if digest in self._blobs:
                return
        data = memoryview(pieces[0]).cast("B") if len(pieces) == 1 else b"".join(pieces)
        with self._lock:
            self._hold(digest, data)

    def _hold(self, digest: str, data: Buffer) -> None:
        """Keep `data` as blob `digest`, the least recently used out until the budget holds (under the lock)."""
        self._blobs[digest] = data
        while sum(memoryview(blob).nbytes for blob in self._blobs.values()) > self.budget_bytes:
            self._blobs.popitem(last=False)

    def _held(self, digest: str) -> Buffer | None:
        data = self._blobs.get(digest)
        if data is not None:
            self._blobs.move_to_end(digest)
        return data
