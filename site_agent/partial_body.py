"""A download's bytes so far: a buffer of the announced length, their running sha256, and how to ask for the rest."""

from __future__ import annotations

import hashlib
import re

__all__ = ["PartialBody"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)", re.ASCII)


class PartialBody:
    """The first `filled` bytes of a body of `size` bytes (-1: not announced), of the blob whose ETag is `etag`."""

    def __init__(self) -> None:
        self.restart(-1, None)

    def restart(self, size: int, etag: str | None) -> None:
        """Drop what is held and expect a whole body of `size` bytes (-1: unknown) from byte 0."""
        self.body = bytearray(size) if size >= 0 else bytearray()
        self.size, self.etag, self.filled = size, etag, 0
        self.adopted = 0  # of the bytes held, those put in the buffer by the caller (`adopt`), not received
        self.digest = hashlib.sha256()

    def adopt(self, count: int) -> None:
        """Hold the buffer's first `count` bytes, put there by the caller; hashed, they are checked with the rest."""
        self.digest.update(memoryview(self.body)[:count])
        self.filled = self.adopted = count

    def add(self, chunk: bytes) -> None:
        """Hash `chunk` and copy it in after the bytes held (past the announced size, the buffer grows)."""
        self.digest.update(chunk)
        end = self.filled + len(chunk)
        if 0 <= self.size and end <= self.size:
            self.body[self.filled : end] = chunk
        else:
            del self.body[self.filled :]
            self.body += chunk
        self.filled = end

    @property
    def complete(self) -> bool:
        """Whether the announced size is held (when none was announced: whatever arrived is the body)."""
        return self.size < 0 or self.filled >= self.size

    def resume_headers(self) -> dict[str, str]:
        """The headers that ask for the rest (none while nothing is held): Range, and If-Range with the ETag."""
        if self.filled == 0:
            return {}
        headers = {"Range": f"bytes={self.filled}-"}
        if self.etag is not None:
            headers["If-Range"] = self.etag
        return headers

    def continues(self, content_range: str | None) -> bool:
        """Whether a 206 answer's Content-Range starts at the first byte missing, of a body of the size expected."""
        found = _CONTENT_RANGE.fullmatch((content_range or "").strip())
        if found is None or int(found.group(1)) != self.filled:
            return False
        return found.group(3) == "*" or self.size < 0 or int(found.group(3)) == self.size

    def finished(self) -> bytearray:
        """The body, cut to the bytes that arrived."""
        del self.body[self.filled :]
        return self.body

    @property
    def sha256(self) -> str:
        """Hex sha256 of the bytes held."""
        return self.digest.hexdigest()
