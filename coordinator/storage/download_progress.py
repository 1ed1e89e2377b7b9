"""Downloads under way: one empty marker file per site's model download, its length the bytes sent so far.

A marker is named by what it follows, `download-<study id>-<model round>-<site id>-<size>-<nonce>.part`, in a
directory every coordinator worker shares (beside the upload sessions), so whichever worker answers the
status call sees a download another one serves. It holds no data: its length is set by one `ftruncate`
(a sparse file, nothing written) to the bytes sent so far, a resumed download counting the bytes before its
Range as the site's already; at most every UPDATE_EVERY_S. The marker is removed when the
response ends, whether sent whole or cut; one left by a worker killed mid-download is not shown once
untouched for STALE_S, and the sweep removes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from starlette.concurrency import iterate_in_threadpool

__all__ = ["DownloadKey", "DownloadsUnderWay", "STALE_S"]

_NAME = re.compile(r"download-(\d+)-(\d+)-(\d+)-(\d+)-[0-9a-f]{16}\.part")
UPDATE_EVERY_S = 0.5  # how often a download's marker follows the bytes sent (the dashboard refreshes every few s)
# A marker untouched this long is a dead worker's: a live one moves at least once a chunk (1 MiB), and a
# chunk takes 80 s at 100 kbit/s.
STALE_S = 300.0

Chunk = TypeVar("Chunk", bytes, memoryview, bytes | memoryview)


@dataclass(frozen=True)
class DownloadKey:
    """Whose download of which model: theta^g after `model_round` of study `study_id`, `size` bytes in all."""

    study_id: int
    model_round: int
    site_id: int
    size: int


class DownloadsUnderWay:
    """The download markers in `directory`."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    async def tracked(
        self, chunks: Iterable[Chunk] | AsyncIterable[Chunk], key: DownloadKey, start: int = 0
    ) -> AsyncIterator[Chunk]:
        """`chunks` (a sync iterable is read in a request thread) as they go, the marker following them."""
        source = chunks if isinstance(chunks, AsyncIterable) else iterate_in_threadpool(iter(chunks))
        handle, path = self._create(key, start)
        sent, marked_at = start, time.monotonic()
        try:
            async for chunk in source:
                yield chunk
                sent += len(chunk)
                if time.monotonic() - marked_at >= UPDATE_EVERY_S:
                    os.ftruncate(handle, sent)
                    marked_at = time.monotonic()
        finally:
            os.close(handle)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _create(self, key: DownloadKey, start: int) -> tuple[int, Path]:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"download-{key.study_id}-{key.model_round}-{key.site_id}-{key.size}-{os.urandom(8).hex()}.part"
        path = self.directory / name
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(handle, start)
        return handle, path

    def held(self, now: float | None = None) -> dict[tuple[int, int], tuple[int, int]]:
        """(bytes sent, size) of each live download, by (study id, site id): one look at the directory.

        A site with two (a resumed download while its cut one has not yet ended) shows the further one.
        """
        now = time.time() if now is None else now
        found: dict[tuple[int, int], tuple[int, int]] = {}
        for entry, match in self._markers():
            with contextlib.suppress(FileNotFoundError):  # ended meanwhile
                status = entry.stat()
                if now - status.st_mtime < STALE_S:
                    owner = (int(match[1]), int(match[3]))
                    found[owner] = max(found.get(owner, (0, 0)), (status.st_size, int(match[4])))
        return found

    def sweep(self, now: float | None = None) -> int:
        """Remove the markers untouched for STALE_S (their workers died mid-download); how many."""
        now = time.time() if now is None else now
        removed = 0
        for entry, _ in self._markers():
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime >= STALE_S:
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def _markers(self) -> list[tuple[os.DirEntry[str], re.Match[str]]]:
        with contextlib.suppress(FileNotFoundError):
            with os.scandir(self.directory) as entries:
                return [(entry, match) for entry in entries if (match := _NAME.fullmatch(entry.name))]
        return []
