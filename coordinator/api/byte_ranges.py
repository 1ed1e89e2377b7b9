"""The one byte range a download's `Range` header asks for (RFC 9110 section 14), so a cut transfer resumes.

Served: `bytes=START-`, `bytes=START-END` and the suffix `bytes=-LENGTH`, each answered 206 with
`Content-Range`. A range that starts past the end, or is not a valid byte range (`bytes=9-2`,
`bytes=x-`), is refused: 416 with `Content-Range: bytes */SIZE`. Ignored, so answered with the whole
body (200): another unit than `bytes`, several ranges at once (no multipart answers), and an `If-Range`
other than the download's strong ETag (its blob changed, or a date: downloads have no Last-Modified).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Header

from coordinator.errors import RangeNotSatisfiable

__all__ = ["ByteRange", "DownloadConditions", "download_conditions", "requested_range"]

_SPEC = re.compile(r"(\d*)-(\d*)", re.ASCII)


@dataclass(frozen=True)
class ByteRange:
    """Bytes `start` (included) to `end` (excluded) of a body of `size` bytes."""

    start: int
    end: int
    size: int

    @property
    def content_range(self) -> str:
        """The Content-Range header of the range."""
        return f"bytes {self.start}-{self.end - 1}/{self.size}"


@dataclass(frozen=True)
class DownloadConditions:
    """The request headers a download answers to: If-None-Match (304), Range and If-Range (206)."""

    if_none_match: str | None = None
    range: str | None = None
    if_range: str | None = None


def download_conditions(
    if_none_match: str | None = Header(None, description='the model\'s ETag ("<sha256>") or *: 304 if it matches'),
    range_: str | None = Header(
        None, alias="range", description="bytes=START- or bytes=START-END (one range): 206 with those bytes"
    ),
    if_range: str | None = Header(None, description="the ETag of the bytes already held: the range only if it holds"),
) -> DownloadConditions:
    """The conditional headers of a download request."""
    return DownloadConditions(if_none_match, range_, if_range)


def requested_range(asked: DownloadConditions, etag: str, size: int) -> ByteRange | None:
    """The range of a body of `size` bytes (strong ETag `etag`) to send; None for the whole body.

    Raises RangeNotSatisfiable for a single bytes range that is invalid or starts past the end.
    """
    if asked.range is None or (asked.if_range is not None and asked.if_range.strip() != etag):
        return None
    unit, equals, specs = asked.range.partition("=")
    if unit.strip().lower() != "bytes" or not equals or "," in specs:
        return None
    spec = _SPEC.fullmatch(specs.strip())
    if spec is None or spec.group(1) == spec.group(2) == "":
        raise RangeNotSatisfiable(asked.range, size)
    first, last = spec.groups()
    if first == "":  # a suffix: the last `last` bytes
        start, end = max(size - int(last), 0), size
    else:
        start, end = int(first), size if last == "" else min(int(last) + 1, size)
        if last != "" and int(last) < start:
            raise RangeNotSatisfiable(asked.range, size)
    if start >= end:
        raise RangeNotSatisfiable(asked.range, size)
    return ByteRange(start, end, size)
