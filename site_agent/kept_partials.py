"""Downloads' first bytes kept on disk, named by the expected sha256, so that a restarted agent asks only for the rest.

Under the folder (mode 0700; the agent keeps it in its store folder, `kept_partials_dir`),
`<sha256>.part` holds the bytes of the blob of that digest as they arrived, and `<sha256>.json` the
ETag and size they came with, both mode 0600. The bytes are never trusted: the download hashes
them with the rest and throws them away on a mismatch. A download that ends, well or with a wrong
digest, removes its files; when one starts, those older than PARTIAL_MAX_AGE_S, and all but the
newest PARTIALS_KEPT - 1 others, are swept. A download holds its file locked; a second download of
the same blob meanwhile keeps nothing on disk.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from io import BufferedRandom
from pathlib import Path

from shared.wire.kept_download import read_kept_record
from site_agent.partial_body import PartialBody
from site_agent.store_files import atomic_write

__all__ = ["PARTIALS_KEPT", "PARTIAL_MAX_AGE_S", "KeptPartial", "KeptPartials", "kept_partials_dir"]

log = logging.getLogger(__name__)

PARTIALS_KEPT = 2  # partial downloads on disk at most, the one under way included
PARTIAL_MAX_AGE_S = 7 * 86_400  # a partial download untouched this long is swept
_DIGEST = re.compile(r"[0-9a-f]{64}", re.ASCII)
_DEBRIS_AGE_S = 3_600.0  # a temporary file of a metadata write this old was left by a crash


def kept_partials_dir(store_dir: Path) -> Path:
    """Where an agent whose store is `store_dir` keeps its partial downloads."""
    return store_dir / "downloads"


class KeptPartial:
    """One blob's kept bytes, its file locked by this download until `close`."""

    def __init__(self, part: Path, handle: BufferedRandom) -> None:
        self.part, self.meta = part, part.with_suffix(".json")
        self._handle = handle
        self.active = True  # False once keeping failed or cannot help a restart: nothing more is written

    def load(self, partial: PartialBody) -> int:
        """Put the kept bytes in `partial`, restarted to the size and ETag they came with: how many (0: none usable)."""
        held = os.fstat(self._handle.fileno()).st_size
        kept = read_kept_record(self.meta) if held else None
        if kept is None or held > kept[0]:
            self._clear()
            return 0
        size, etag = kept
        partial.restart(size, etag)
        self._handle.seek(0)
        got = self._handle.readinto(memoryview(partial.body)[:held])
        if got != held:
            partial.restart(-1, None)
            self._clear()
            return 0
        partial.adopt(got)
        self._handle.seek(got)
        return got

    def begin(self, size: int, etag: str | None) -> None:
        """Keep a body of `size` bytes with `etag` from byte 0; without both, a restart could not resume it."""
        if not self.active:
            return
        if etag is None or size < 0:
            self._stop()
            return
        try:
            self._clear()
            atomic_write(self.meta, json.dumps({"etag": etag, "size": size}).encode())
        except OSError as exc:
            self._stop(exc)

    def append(self, chunk: bytes) -> None:
        """Write `chunk` after the bytes kept."""
        if not self.active:
            return
        try:
            self._handle.write(chunk)
        except OSError as exc:
            self._stop(exc)

    def discard(self) -> None:
        """Remove the kept bytes: the download ended, or they are not the blob's."""
        self._stop()

    def close(self) -> None:
        """Write out what is buffered and unlock: the bytes stay for the next start, unless discarded."""
        try:
            self._handle.close()
        except OSError as exc:
            log.warning("cannot finish writing the partial download %s: %s", self.part, exc)

    def _clear(self) -> None:
        """No byte kept, no record of them."""
        self.meta.unlink(missing_ok=True)
        self._handle.seek(0)
        self._handle.truncate(0)

    def _stop(self, exc: OSError | None = None) -> None:
        if exc is not None:
            log.warning(
                "cannot keep the partial download %s on disk (%s); a restart will download it whole", self.part, exc
            )
        self.active = False
        try:
            self.meta.unlink(missing_ok=True)
            self.part.unlink(missing_ok=True)
            self._handle.seek(0)
            self._handle.truncate(0)
        except OSError as error:
            log.warning("cannot remove the partial download %s: %s", self.part, error)


class KeptPartials:
    """The folder of an agent's partial downloads."""

    def __init__(self, root: Path, *, kept: int = PARTIALS_KEPT, max_age_s: float = PARTIAL_MAX_AGE_S) -> None:
        self.root, self.kept, self.max_age_s = root, kept, max_age_s

    def open(self, sha256: str) -> KeptPartial | None:
        """The kept bytes of the blob of digest `sha256`, locked; None when they cannot be kept (logged)."""
        if not _DIGEST.fullmatch(sha256):
            return None
        part = self.root / f"{sha256}.part"
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.sweep(sha256)
            fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            log.warning("cannot keep partial downloads in %s (%s); a restart will download them whole", self.root, exc)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)
        except OSError:  # BlockingIOError: another download of the same blob holds it
            os.close(fd)
            log.info("%s is being downloaded already; this download keeps nothing on disk", sha256[:12])
            return None
        return KeptPartial(part, open(fd, "r+b"))  # noqa: SIM115 - closed by KeptPartial.close

    def sweep(self, current: str) -> None:
        """Remove the partial downloads too old, and all but the newest PARTIALS_KEPT - 1 other than `current`'s."""
        now = time.time()
        others = sorted(
            ((_mtime(p), p) for p in self.root.glob("*.part") if _DIGEST.fullmatch(p.stem) and p.stem != current),
            reverse=True,
        )
        for index, (mtime, part) in enumerate(others):
            if index >= self.kept - 1 or now - mtime > self.max_age_s:
                _remove_unless_locked(part)
        for meta in self.root.glob("*.json"):
            if meta.stem != current and not meta.with_suffix(".part").exists():
                meta.unlink(missing_ok=True)
        for debris in self.root.glob(".*.tmp"):
            if now - _mtime(debris) > _DEBRIS_AGE_S:
                debris.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    """When `path` was last written; 0 for a file gone meanwhile (the oldest: swept first)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _remove_unless_locked(part: Path) -> None:
    """Remove a partial download and its record, unless a download holds it."""
    try:
        fd = os.open(part, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    try:
        part.with_suffix(".json").unlink(missing_ok=True)
        part.unlink(missing_ok=True)
        log.info("removed the partial download %s", part.name)
    finally:
        os.close(fd)
