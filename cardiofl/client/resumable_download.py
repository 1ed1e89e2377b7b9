"""A download into a file over a flaky link: `<out>.part` resumed by Range, its sha256 checked, then renamed."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from io import BufferedRandom
from pathlib import Path

import httpx

from cardiofl.client.http import ApiError, refusal, unreachable
from shared.wire.kept_download import read_kept_record

__all__ = ["RETRIES", "DownloadError", "Downloaded", "FileDownload", "partial_paths", "strong_digest"]

RETRIES = 5  # failed tries in a row (a try that brought new bytes starts the count again) before giving up
FIRST_DELAY_S, MAX_DELAY_S = 1.0, 30.0  # the wait before trying again, doubling after each try that failed
CHUNK_BYTES = 1 << 20  # kept bytes are read back and hashed a chunk at a time
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)", re.ASCII)
_SHA256_ETAG = re.compile(r'"([0-9a-f]{64})"', re.ASCII)

OnProgress = Callable[[int, int], None]  # (bytes held, the whole size; -1 while not announced)
Notify = Callable[[str], None]


class DownloadError(ApiError):
    """A download that cannot finish: cut too often, answered oddly, or of bytes that are not the model's."""


@dataclass(frozen=True)
class Downloaded:
    """A file downloaded whole and checked: its size and sha256, the bytes kept from an earlier run, those received."""

    path: Path
    size: int
    sha256: str
    resumed_from: int
    received: int


def partial_paths(out: Path) -> tuple[Path, Path]:
    """Where a download into `out` keeps its bytes so far (`.part`), and the ETag and size they came with."""
    return out.with_name(out.name + ".part"), out.with_name(out.name + ".part.json")


def strong_digest(etag: str | None) -> str | None:
    """The sha256 a strong ETag `"<sha256>"` names; None for any other ETag."""
    found = _SHA256_ETAG.fullmatch((etag or "").strip())
    return found.group(1) if found else None


class FileDownload:
    """GET `url` into `out` through `<out>.part`, resumed after a cut and by a later run, renamed once its digest holds.

    The bytes are written to `<out>.part` as they arrive and hashed as they go; `<out>.part.json` keeps
    the ETag and size they came with. A cut transfer is tried again (`retries` failed tries in a row,
    waiting 1, 2, 4 ... s) with `Range: bytes=N-` and `If-Range: <ETag>`, and so is a later run's; an
    answer of the whole body instead (the model changed) starts again from byte 0. The whole file must
    hash to `sha256` and to the sha256 a strong ETag names: otherwise both partial files are removed and
    DownloadError says so; nothing is ever left under `out` but a checked file, renamed there atomically.
    """

    def __init__(
        self,
        http: httpx.Client,
        url: str,
        out: Path,
        *,
        sha256: str | None = None,
        retries: int = RETRIES,
        delay_s: float = FIRST_DELAY_S,
        on_progress: OnProgress | None = None,
        notify: Notify | None = None,
    ) -> None:
        self.http, self.url, self.out, self.sha256 = http, url, out, sha256
        self.retries, self.delay_s = retries, delay_s
        self.on_progress, self.notify = on_progress, notify or (lambda _: None)
        self.part, self.meta = partial_paths(out)
        self.size, self.filled = -1, 0
        self.etag: str | None = None
        self.digest, self.hashed = hashlib.sha256(), 0  # the digest of the part file's first `hashed` bytes
        self.resumed_from = self.received = 0

    def run(self) -> Downloaded:
        """Download, check and rename; DownloadError (or ApiError for a refusal) when it cannot."""
        try:
            with self._locked_part() as handle:
                if not self._load(handle) or self.filled != self.size:
                    self._transfer(handle)
                digest = self._check(handle)
                handle.flush()
                os.fsync(handle.fileno())
                os.replace(self.part, self.out)
                self.meta.unlink(missing_ok=True)
        except OSError as exc:
            raise DownloadError(f"cannot write the download into {self.out}: {exc}") from None
        return Downloaded(self.out, self.filled, digest, self.resumed_from, self.received)

    def _locked_part(self) -> BufferedRandom:
        """`<out>.part` open for reading and writing, locked against a second download into the same file."""
        fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DownloadError(f"another download into {self.out} is under way ({self.part} is locked)") from None
        return open(fd, "r+b")  # noqa: SIM115 - the caller's `with` closes it

    def _load(self, handle: BufferedRandom) -> int:
        """Take the bytes an earlier run kept, if their record is sound: how many (0: none, the files cleared)."""
        held = os.fstat(handle.fileno()).st_size
        kept = read_kept_record(self.meta) if held else None
        if kept is None or held > kept[0]:
            self._restart(handle, -1, None)
            return 0
        self.size, self.etag = kept
        self.filled = self.resumed_from = held
        if self.on_progress is not None:
            self.on_progress(held, self.size)
        self.notify(f"resuming the download into {self.out} from {held:,} of {self.size:,} bytes kept in {self.part}")
        return held

    def _restart(self, handle: BufferedRandom, size: int, etag: str | None) -> None:
        """Drop the bytes held and expect a body of `size` bytes (-1: unknown) with `etag` from byte 0."""
        handle.seek(0)
        handle.truncate(0)
        self.size, self.etag, self.filled, self.resumed_from = size, etag, 0, 0
        self.digest, self.hashed = hashlib.sha256(), 0
        if etag is None or size < 0:  # a later run could not ask for the rest of this one
            self.meta.unlink(missing_ok=True)
            return
        record = self.meta.with_name(self.meta.name + ".tmp")
        record.write_text(json.dumps({"url": self.url, "etag": etag, "size": size}))
        os.replace(record, self.meta)

    def _transfer(self, handle: BufferedRandom) -> None:
        """GET the bytes missing, trying again after a cut as the class says, until the announced size is held."""
        failures, delay = 0, self.delay_s
        while True:
            before, cut = self.filled, None
            try:
                self._receive(handle)
            except httpx.TransportError as exc:
                cut = exc
            handle.flush()  # what arrived stays for a later run, whatever happens next
            if cut is None and (self.size < 0 or self.filled >= self.size):
                return
            failures, delay = (1, self.delay_s) if self.filled > before else (failures + 1, delay)
            why = unreachable(self.http.base_url, cut) if cut is not None else "the body ended early"
            if failures > self.retries:
                raise DownloadError(
                    f"{why}; the download stopped at {self.filled:,} of {self.size:,} bytes, kept in {self.part}: "
                    "run the command again to resume it"
                )
            self.notify(f"download cut at {self.filled:,} of {self.size:,} bytes ({why}); resuming in {delay:g} s")
            time.sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)

    def _receive(self, handle: BufferedRandom) -> None:
        """One GET of the bytes missing (all of them at first), written and hashed as they arrive."""
        while True:
            asked = self._resume_headers()
            with self.http.stream("GET", self.url, headers=asked) as response:
                if response.status_code == 416 and asked:  # the model is shorter than the bytes kept: not theirs
                    response.read()
                    self.notify("the coordinator has no bytes past those kept; starting over from byte 0")
                    self._restart(handle, -1, None)
                    continue
                self._start_body(handle, response, bool(asked))
                for chunk in response.iter_bytes():  # as they arrive: memory holds one chunk at a time
                    handle.write(chunk)
                    self.digest.update(chunk)
                    self.filled += len(chunk)
                    self.hashed = self.filled
                    self.received += len(chunk)
                    if self.on_progress is not None:
                        self.on_progress(self.filled, self.size)
                return

    def _resume_headers(self) -> dict[str, str]:
        """Range and If-Range asking for the bytes after those held; none while nothing (or no ETag) is held."""
        if not self.filled or self.etag is None:
            return {}
        return {"Range": f"bytes={self.filled}-", "If-Range": self.etag}

    def _start_body(self, handle: BufferedRandom, response: httpx.Response, ranged: bool) -> None:
        """Place the answer's body: after the bytes held (206 to a Range), or from byte 0 (200); refuse any other."""
        if response.status_code >= 400:
            response.read()
            raise refusal(response)
        if response.status_code == 206 and ranged:
            content_range = response.headers.get("content-range")
            found = _CONTENT_RANGE.fullmatch((content_range or "").strip())
            total = found.group(3) if found else None
            if found is None or int(found.group(1)) != self.filled or total not in ("*", str(self.size)):
                raise DownloadError(f"asked for the bytes from {self.filled:,}, the coordinator sent {content_range}")
            self._hash_held(handle)
            return
        if response.status_code != 200:
            raise DownloadError(f"the coordinator answered {response.status_code} to a download of {self.url}")
        if self.filled:
            self.notify("the model is not the one of the bytes kept (its ETag changed); starting over from byte 0")
        self._restart(handle, int(response.headers.get("content-length", "-1")), response.headers.get("etag"))
        if self.on_progress is not None:
            self.on_progress(0, self.size)

    def _hash_held(self, handle: BufferedRandom) -> None:
        """Hash the bytes held but not hashed yet (those kept by an earlier run), reading them a chunk at a time."""
        handle.seek(self.hashed)
        while self.hashed < self.filled:
            chunk = handle.read(min(CHUNK_BYTES, self.filled - self.hashed))
            if not chunk:
                raise DownloadError(f"{self.part} is shorter than its {self.filled:,} bytes: another program cut it")
            self.digest.update(chunk)
            self.hashed += len(chunk)
        handle.seek(self.filled)

    def _check(self, handle: BufferedRandom) -> str:
        """The sha256 of the whole file, if it is the model's; else the partial files are removed and DownloadError."""
        self._hash_held(handle)
        got = self.digest.hexdigest()
        wanted = {digest for digest in (self.sha256, strong_digest(self.etag)) if digest is not None}
        if wanted <= {got} and (self.size < 0 or self.filled == self.size):
            return got
        handle.seek(0)
        handle.truncate(0)
        self.meta.unlink(missing_ok=True)
        self.part.unlink(missing_ok=True)
        raise DownloadError(
            f"the {self.filled:,} bytes downloaded for {self.out} hash to sha256 {got}, not the model's "
            f"{' / '.join(sorted(wanted))}: they were removed and {self.out} not written; "
            "run the command again to download the model whole"
        )
