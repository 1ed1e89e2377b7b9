"""A database blob's bytes as ordered parts of at most PART_BYTES: written a part at a time, read a range at a time.

One database value is bounded (SQLite 1,000,000,000 bytes, a PostgreSQL bytea 1 GiB) and a driver
binds or fetches it whole, so a blob is stored as rows of blob_parts (coordinator.models.BlobPart):
part `seq` holds the bytes from the sum of the lengths before it. Writing takes the bytes as pieces
(the header, then each tensor's bytes: shared.tensors.codec.dump_pieces) and copies only what fills
one part; reading finds a range's part(s) from their lengths, so no reader ever holds a blob whole
unless it asks for all of it.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate
from typing import Any, cast

from sqlalchemy import insert
from sqlalchemy.orm import Session

from coordinator.models import BlobPart

__all__ = ["PART_BYTES", "Buffer", "PartedReader", "digest_of_pieces", "insert_parts", "part_rows"]

PART_BYTES = 64 << 20  # the largest part: small enough for any driver, large enough that a model is few rows
Buffer = bytes | bytearray | memoryview


def digest_of_pieces(pieces: Iterable[Buffer]) -> str:
    """Hex sha256 of the concatenation of `pieces`."""
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def part_rows(pieces: Iterable[Buffer], part_bytes: int) -> Iterator[Buffer]:
    """The bytes of `pieces` cut into parts of `part_bytes` (the last one shorter, none empty).

    A part lying within one piece is a view of it; only a part that spans pieces is copied, into a
    buffer of one part, so at most one part is ever copied at a time.
    """
    pending = bytearray()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view:
            if not pending and len(view) >= part_bytes:
                yield view[:part_bytes]
                view = view[part_bytes:]
                continue
            taken = min(part_bytes - len(pending), len(view))
            pending += view[:taken]
            view = view[taken:]
            if len(pending) == part_bytes:
                yield pending
                pending = bytearray()
    if pending:
        yield pending


def insert_parts(session: Session, digest: str, pieces: Iterable[Buffer]) -> int:
    """INSERT the parts of blob `digest` (whose row the caller has written), one statement per part; the byte count."""
    written = 0
    for seq, part in enumerate(part_rows(pieces, PART_BYTES)):
        session.execute(insert(BlobPart).values(sha256=digest, seq=seq, data=part))
        written += len(part)
    return written


class PartedReader:
    """`read(offset, length)` over a blob's parts, given each part's length and a reader of one part's range.

    `fetch(index, offset, length)` returns `length` bytes of part `index` from `offset` within it.
    A range within one part is that part's answer as it is; a range across parts is joined.
    """

    def __init__(self, lengths: Sequence[int], fetch: Callable[[int, int, int], Buffer]) -> None:
        self.starts = [0, *accumulate(lengths)]
        self.size = self.starts[-1]
        self._fetch = fetch

    def read(self, offset: int, length: int) -> Buffer:
        """Bytes `offset` to `offset + length` (fewer at the end of the blob)."""
        end = min(offset + length, self.size)
        if offset >= end:
            return b""
        index = bisect.bisect_right(self.starts, offset) - 1
        if end <= self.starts[index + 1]:
            return self._fetch(index, offset - self.starts[index], end - offset)
        joined, begin = bytearray(end - offset), offset  # filled a part at a time: never two copies whole
        while offset < end:
            taken = min(end, self.starts[index + 1]) - offset
            joined[offset - begin : offset - begin + taken] = self._fetch(index, offset - self.starts[index], taken)
            offset += taken
            index += 1
        return joined


def sqlite_part_reader(dbapi: Any, digest: str, opened: Callable[[Any], Any]) -> PartedReader:
    """A PartedReader over blob `digest`'s parts in SQLite, each read through an incremental blob handle.

    `opened(handle)` enters a handle into the caller's context (an ExitStack), so the handles close
    with it; a part's handle is opened the first time it is read.
    """
    rows = dbapi.execute(
        f"SELECT rowid, length(data) FROM {BlobPart.__tablename__} WHERE sha256 = ? ORDER BY seq", (digest,)
    ).fetchall()
    handles: dict[int, Any] = {}

    def fetch(index: int, offset: int, length: int) -> bytes:
        if index not in handles:
            handles[index] = opened(dbapi.blobopen(BlobPart.__tablename__, "data", rows[index][0], readonly=True))
        return cast(bytes, handles[index][offset : offset + length])

    return PartedReader([length for _, length in rows], fetch)


def postgres_part_lengths(session: Session, digest: str) -> list[int]:
    """The lengths of blob `digest`'s parts in PostgreSQL, in order (octet_length reads no part's bytes)."""
    dbapi = session.connection().connection.dbapi_connection
    with dbapi.cursor() as cursor:  # type: ignore[union-attr]
        rows = cursor.execute(
            f"SELECT octet_length(data) FROM {BlobPart.__tablename__} WHERE sha256 = %s ORDER BY seq", (digest,)
        ).fetchall()
    return [row[0] for row in rows]


def postgres_part_range(session: Session, digest: str, seq: int, offset: int, length: int) -> bytes:
    """`length` bytes of part `seq` of blob `digest` from `offset`, fetched in binary (no hex text of bytea)."""
    dbapi = session.connection().connection.dbapi_connection
    with dbapi.cursor(binary=True) as cursor:  # type: ignore[union-attr]
        row = cursor.execute(
            f"SELECT substring(data FROM %s FOR %s) FROM {BlobPart.__tablename__} WHERE sha256 = %s AND seq = %s",
            (offset + 1, length, digest, seq),
        ).fetchone()
    return bytes(row[0]) if row is not None else b""
