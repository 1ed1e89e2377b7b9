"""Upload sessions: an update's bytes arriving in chunks over several requests, into one file per session.

A session is named by what it will hold: `session-<round id>-<site id>-<size>-<sha256>.part`, in a
directory every coordinator worker shares (beside the blob store's, so the finished file is renamed
into place). The bytes the coordinator holds, its acknowledged offset, are the file's length: a
chunk is appended only at that offset, by one request at a time (an exclusive `flock` on the file,
which a worker that dies lets go of), and is fsynced before its offset is answered. The digest is
checked over the whole file once the last byte is in; a session untouched for a while is swept.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

__all__ = ["SessionBusy", "SessionFile", "SessionKey", "UploadSessions"]

_NAME = re.compile(r"session-(\d+)-(\d+)-(\d+)-([0-9a-f]{64})\.part")
WAIT_STEP_S = 0.02  # how often a reader looks again whether a chunk's writer has finished


class Spares(Protocol):
    """Where released update files wait to be written over (coordinator.storage.update_files.FileBlobStore)."""

    def claim_spare(self, size_hint: int, target: Path) -> bool:
        """Move a spare to `target`, emptied; False when there is none."""
        ...


class SessionBusy(Exception):
    """Another request is writing a chunk of this session now."""


@dataclass(frozen=True)
class SessionKey:
    """What a session will hold: an update of `size` bytes and digest `sha256`, by a site for a round attempt."""

    round_id: int
    site_id: int
    size: int
    sha256: str

    @property
    def name(self) -> str:
        """The session's file name."""
        return f"session-{self.round_id}-{self.site_id}-{self.size}-{self.sha256}.part"


class SessionFile:
    """A session's file, locked for one request's chunk: `offset` is the byte the chunk must start at."""

    def __init__(self, path: Path, handle: BinaryIO, size: int) -> None:
        self.path, self.size, self._handle = path, size, handle
        self.offset = os.fstat(handle.fileno()).st_size

    def append(self, chunk: bytes | bytearray | memoryview) -> None:
        """Write `chunk` at the end of the file."""
        self._handle.write(chunk)
        self.offset += len(chunk)

    def sync(self) -> None:
        """Have every byte written on disk: the offset may be acknowledged."""
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def truncate(self, offset: int) -> None:
        """Forget the bytes from `offset` on."""
        self._handle.truncate(offset)
        self._handle.seek(offset)
        self.offset = offset


class UploadSessions:
    """The session files in `directory`."""

    def __init__(self, directory: Path | str, spares: Spares | None = None) -> None:
        self.directory = Path(directory)
        self.spares = spares  # the blob store's released files: a new session's file is one of them when it can be

    def path(self, key: SessionKey) -> Path:
        """Where session `key` keeps its bytes."""
        return self.directory / key.name

    def start(self, key: SessionKey) -> tuple[int, bool]:
        """(offset, whether new) of session `key`, created empty if absent; the site's other ones of the round go."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for other in self._of(key.round_id, key.site_id):
            if other != key:
                self.remove(other)
        path = self.path(key)
        fresh = self.directory / f"claim-{os.urandom(8).hex()}.tmp"
        if self.spares is None or not self.spares.claim_spare(key.size, fresh):
            os.close(os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            os.link(fresh, path)  # the name is claimed whole, by one request: an empty file, new or a spare
        except FileExistsError:
            return self.offset(key, wait_s=0.0), False
        finally:
            fresh.unlink()
        return 0, True

    def find(self, round_id: int, site_id: int, sha256: str) -> SessionKey | None:
        """The site's session of the round for digest `sha256`, if there is one."""
        return next((key for key in self._of(round_id, site_id) if key.sha256 == sha256), None)

    def offset(self, key: SessionKey, *, wait_s: float) -> int:
        """The bytes session `key` holds, once a chunk being written ends (waiting up to `wait_s`); -1: no session."""
        try:
            handle = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return -1
        try:
            give_up = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= give_up:
                        break  # still being written: its length so far, which only grows
                    time.sleep(WAIT_STEP_S)
            return os.fstat(handle).st_size
        finally:
            os.close(handle)

    @contextmanager
    def writing(self, key: SessionKey) -> Iterator[SessionFile]:
        """Session `key`'s file, locked for this request's chunk; SessionBusy while another one writes it."""
        handle = open(self.path(key), "r+b")  # noqa: SIM115 - closed below; FileNotFoundError: no such session
        try:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SessionBusy(key.name) from None
            handle.seek(0, os.SEEK_END)
            yield SessionFile(self.path(key), handle, key.size)
        finally:
            handle.close()

    def remove(self, key: SessionKey) -> None:
        """Forget session `key` and its bytes."""
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()

    def sweep(self, *, older_than_s: float, open_rounds: Container[int]) -> int:
        """Remove sessions untouched for `older_than_s`, or of a round attempt not in `open_rounds`; how many."""
        cutoff, removed = time.time() - older_than_s, 0
        for key in self.keys():
            with contextlib.suppress(FileNotFoundError):
                if key.round_id not in open_rounds or self.path(key).stat().st_mtime < cutoff:
                    self.remove(key)
                    removed += 1
        return removed

    def held(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(bytes held, size) of each session, by (round id, site id): one look at the directory, no file opened.

        The directory holds only sessions under way (a finished one is renamed away, a stale one swept), so
        this costs one stat per upload in progress. A length read while a chunk is written is its length so far.
        """
        found: dict[tuple[int, int], tuple[int, int]] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                match = _NAME.fullmatch(entry.name)
                if match is None:
                    continue
                with contextlib.suppress(FileNotFoundError):  # finished or swept meanwhile
                    held, size = entry.stat().st_size, int(match[3])
                    owner = (int(match[1]), int(match[2]))
                    found[owner] = max(found.get(owner, (0, 0)), (held, size))  # two only while one replaces the other
        return found

    def keys(self) -> list[SessionKey]:
        """Every session in the directory."""
        found = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                match = _NAME.fullmatch(entry.name)
                if match is not None:
                    round_id, site_id, size, sha256 = match.groups()
                    found.append(SessionKey(int(round_id), int(site_id), int(size), sha256))
        return found

    def _of(self, round_id: int, site_id: int) -> list[SessionKey]:
        return [key for key in self.keys() if (key.round_id, key.site_id) == (round_id, site_id)]
