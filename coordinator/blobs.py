"""Content-addressed safetensors blobs kept in the database, keyed by their sha256; read whole or a range at a time."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, func, literal_column, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from coordinator.errors import NotFound
from coordinator.models import Blob

__all__ = ["BlobReader", "blob_chunks", "open_blob", "open_blobs", "put_blob", "read_blob", "read_range", "sha256_of"]

WINDOW_BYTES = 16 << 20  # PostgreSQL: bytes fetched per query when a blob is read a range at a time
CHUNK_BYTES = 1 << 20  # a download is sent in chunks of this size, each read on its own


def sha256_of(data: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def put_blob(session: Session, data: bytes | bytearray | memoryview, digest: str | None = None) -> str:
    """Store `data` unless a blob with its digest exists (two writers of equal bytes both succeed).

    On SQLite the row is inserted with a zero blob of the right size that is then overwritten a
    chunk at a time (incremental blob I/O): SQLite makes no whole copies of the data on the way.
    """
    digest = digest or sha256_of(data)
    if session.get_bind().dialect.name != "sqlite":
        values = {"sha256": digest, "size": len(data), "data": data}
        session.execute(postgresql.insert(Blob).values(**values).on_conflict_do_nothing(index_elements=["sha256"]))
        return digest
    values = {"sha256": digest, "size": len(data), "data": func.zeroblob(len(data))}
    inserted = session.execute(sqlite.insert(Blob).values(**values).on_conflict_do_nothing(index_elements=["sha256"]))
    if inserted.rowcount == 1 and len(data):
        rowid = session.scalar(select(literal_column("rowid")).select_from(Blob).where(Blob.sha256 == digest))
        dbapi = session.connection().connection.dbapi_connection
        view = memoryview(data).cast("B")
        with dbapi.blobopen(Blob.__tablename__, "data", rowid) as handle:  # type: ignore[union-attr]
            for offset in range(0, len(view), CHUNK_BYTES):
                handle.write(view[offset : offset + CHUNK_BYTES])
    return digest


def read_blob(session: Session, digest: str) -> bytes:
    """The bytes of blob `digest`."""
    connection = session.connection()
    if connection.dialect.driver == "psycopg":
        # A binary-format cursor spares the hex text encoding of bytea: several times faster.
        with connection.connection.dbapi_connection.cursor(binary=True) as cursor:  # type: ignore[union-attr]
            row = cursor.execute(f"SELECT data FROM {Blob.__tablename__} WHERE sha256 = %s", (digest,)).fetchone()
        data = row[0] if row is not None else None
    else:
        data = session.scalar(select(Blob.data).where(Blob.sha256 == digest))
    if data is None:
        raise NotFound(f"blob {digest}")
    return data if isinstance(data, bytes) else bytes(data)


@dataclass(frozen=True)
class BlobReader:
    """An open blob: its size, and `read(offset, size)` returning that range of its bytes."""

    size: int
    read: Callable[[int, int], bytes]


@contextmanager
def open_blob(session: Session, digest: str, *, prefetch: int = WINDOW_BYTES) -> Iterator[BlobReader]:
    """Blob `digest` opened for reading a range at a time, so that it is never whole in memory.

    SQLite reads straight from the database file (incremental blob I/O); PostgreSQL fetches at
    least `prefetch` bytes per query; other databases read the blob whole. Valid inside `session`'s
    transaction.
    """
    connection = session.connection()
    if connection.dialect.name == "sqlite":
        row = session.execute(
            select(literal_column("rowid"), Blob.size).select_from(Blob).where(Blob.sha256 == digest)
        ).first()
        if row is None:
            raise NotFound(f"blob {digest}")
        rowid, size = row
        dbapi = connection.connection.dbapi_connection
        with dbapi.blobopen(Blob.__tablename__, "data", rowid, readonly=True) as handle:  # type: ignore[union-attr]
            yield BlobReader(size, _slicer(handle))
    elif connection.dialect.driver == "psycopg":
        size = session.scalar(select(Blob.size).where(Blob.sha256 == digest))
        if size is None:
            raise NotFound(f"blob {digest}")
        yield BlobReader(size, _PostgresWindow(session, digest, prefetch).read)
    else:
        data = read_blob(session, digest)
        yield BlobReader(len(data), lambda offset, length: data[offset : offset + length])


class _PostgresWindow:
    """Serves ranges of a bytea from windows of at least `prefetch` bytes fetched with substring()."""

    def __init__(self, session: Session, digest: str, prefetch: int) -> None:
        self.session, self.digest, self.prefetch = session, digest, prefetch
        self.start, self.data = 0, b""

    def read(self, offset: int, length: int) -> bytes:
        if not (self.start <= offset and offset + length <= self.start + len(self.data)):
            self.start, self.data = offset, self._fetch(offset, max(length, self.prefetch))
        begin = offset - self.start
        return self.data[begin : begin + length]

    def _fetch(self, offset: int, length: int) -> bytes:
        dbapi = self.session.connection().connection.dbapi_connection
        with dbapi.cursor(binary=True) as cursor:  # type: ignore[union-attr]
            row = cursor.execute(
                f"SELECT substring(data FROM %s FOR %s) FROM {Blob.__tablename__} WHERE sha256 = %s",
                (offset + 1, length, self.digest),
            ).fetchone()
        return bytes(row[0]) if row is not None else b""


@contextmanager
def open_blobs(engine: Engine, digests: Sequence[str], *, prefetch: int = WINDOW_BYTES) -> Iterator[list[BlobReader]]:
    """Blobs `digests` opened for reading a range at a time (see open_blob), without taking a write lock.

    On SQLite they are read outside any transaction on a pooled connection, each blob handle on a
    WAL snapshot of its own, so the reads neither wait for nor block a writer (this module's
    sessions begin IMMEDIATE) and several threads may read at once, each with its own call. On
    PostgreSQL they are read in a session of their own.
    """
    if engine.dialect.name != "sqlite":
        with Session(engine) as session, ExitStack() as stack:
            yield [stack.enter_context(open_blob(session, digest, prefetch=prefetch)) for digest in digests]
        return
    connection = engine.raw_connection()
    try:
        dbapi = connection.dbapi_connection
        with ExitStack() as stack:
            readers = []
            for digest in digests:
                query = f"SELECT rowid, size FROM {Blob.__tablename__} WHERE sha256 = ?"
                row = dbapi.execute(query, (digest,)).fetchone()  # type: ignore[union-attr]
                if row is None:
                    raise NotFound(f"blob {digest}")
                handle = stack.enter_context(dbapi.blobopen(Blob.__tablename__, "data", row[0], readonly=True))  # type: ignore[union-attr]
                readers.append(BlobReader(row[1], _slicer(handle)))
            yield readers
    finally:
        connection.close()  # back to the pool


def _slicer(handle: Any) -> Callable[[int, int], bytes]:
    """`read(offset, length)` over an open SQLite blob handle."""
    return lambda offset, length: handle[offset : offset + length]


def read_range(engine: Engine, digest: str, offset: int, length: int) -> bytes:
    """`length` bytes of blob `digest` from `offset`, in a read of its own that takes no write lock (see open_blobs)."""
    with open_blobs(engine, [digest], prefetch=0) as (blob,):
        return blob.read(offset, length)


def blob_chunks(engine: Engine, digest: str, size: int) -> Iterator[bytes]:
    """The `size` bytes of blob `digest` as CHUNK_BYTES chunks, each read on its own (see read_range).

    Blobs never change, so the chunks of separate reads fit together, and nothing is held while a
    chunk travels to a slow client.
    """
    for offset in range(0, size, CHUNK_BYTES):
        chunk = read_range(engine, digest, offset, min(CHUNK_BYTES, size - offset))
        if not chunk:
            raise NotFound(f"blob {digest} ends before byte {offset}")
        yield chunk
