"""Content-addressed safetensors blobs, keyed by their sha256; read whole or a range at a time.

Global models (theta^g_t, phi_0) are kept in the database, as ordered parts of at most 64 MiB
(coordinator.storage.blob_parts), so that a model of any size is stored and streamed. Uploaded
updates are kept in the blob store (coordinator.storage.update_files) when one is configured, the
database row holding their digest, size and block checksums; without a store, they are in the
database too. Readers find a blob wherever its row says it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from coordinator.db import BLOB_STORE
from coordinator.errors import NotFound
from coordinator.models import Blob, BlobLocation
from coordinator.storage.blob_parts import (
    Buffer,
    PartedReader,
    digest_of_pieces,
    insert_parts,
    postgres_part_lengths,
    postgres_part_range,
    sqlite_part_reader,
)
from coordinator.storage.update_files import BlobStore, IncomingBlob, StoredBlobError

__all__ = [
    "blob_store_of",
    "BlobReader",
    "blob_chunks",
    "open_blob",
    "open_blobs",
    "put_blob",
    "put_update_blob",
    "read_blob",
    "read_range",
    "sha256_of",
]

WINDOW_BYTES = 16 << 20  # PostgreSQL: bytes fetched per query when a blob is read a range at a time
CHUNK_BYTES = 1 << 20  # a download is sent in chunks of this size, each read on its own


def sha256_of(data: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def put_blob(session: Session, data: Buffer | Sequence[Buffer], digest: str | None = None) -> str:
    """Store `data` (bytes, or pieces in order) in the database unless a blob with its digest exists; its digest.

    Two writers of equal bytes both succeed: the second finds the row and writes no part. The bytes
    go in one INSERT per part (blob_parts.insert_parts), so the driver's transient copy is one part,
    never the whole model; pieces are copied only where a part spans them.
    """
    pieces: Sequence[Buffer] = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    digest = digest or digest_of_pieces(pieces)
    size = sum(memoryview(piece).nbytes for piece in pieces)
    insert = postgresql.insert(Blob) if session.get_bind().dialect.name == "postgresql" else sqlite.insert(Blob)
    values = {"sha256": digest, "size": size}
    statement = insert.values(**values).on_conflict_do_nothing(index_elements=["sha256"]).returning(Blob.sha256)
    if session.execute(statement).scalar() is not None:  # this writer inserted the row: the parts are its to write
        insert_parts(session, digest, pieces)
    return digest


def put_update_blob(
    session: Session,
    store: BlobStore | None,
    data: bytes | bytearray | memoryview,
    digest: str,
    *,
    incoming: IncomingBlob | None = None,
) -> None:
    """Store an accepted update in `store`, or in the database when there is none; inside the update's transaction.

    `incoming` is the update spooled into the store as it arrived; without it `data` is written there.

    The blob's row is written (and on PostgreSQL locked) before its file is renamed into place, so a
    release of the same digest (coordinator.storage.retention) runs either wholly before or wholly after.
    """
    if store is None:
        put_blob(session, data, digest)
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert(Blob) if dialect == "postgresql" else sqlite.insert(Blob)
    row = {"sha256": digest, "size": len(data), "location": BlobLocation.STORE}
    if incoming is None:
        with store.incoming() as written:
            written.write(data)
            put_update_blob(session, store, data, digest, incoming=written)
        return
    incoming.finish()
    if incoming.sha256 != digest:
        raise ValueError(f"the spooled update hashes to {incoming.sha256}, not {digest}")
    if _upsert_stored(session, insert, row, incoming.checksums) == BlobLocation.STORE:
        store.add(incoming)


def _upsert_stored(session: Session, insert: Any, row: dict[str, Any], checksums: bytes) -> str:
    """Insert the row of a stored blob, or bring back one whose file was released; returns where the blob is.

    A blob with these bytes kept in the database already stays there. On PostgreSQL the row is
    then held (FOR UPDATE) until the transaction ends.
    """
    statement = insert.values(**row, checksums=checksums)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["sha256"],
            set_={"location": BlobLocation.STORE, "checksums": checksums},
            where=Blob.location == BlobLocation.RELEASED,
        )
    )
    query = select(Blob.location).where(Blob.sha256 == row["sha256"])
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update()
    location = session.scalar(query)
    assert location is not None  # the row was just inserted, or was there already
    return location


def read_blob(session: Session, digest: str) -> bytes:
    """The bytes of blob `digest`, kept in the database, whole (a blob in the blob store is read with open_blobs)."""
    location = session.scalar(select(Blob.location).where(Blob.sha256 == digest))
    if location is not None and location != BlobLocation.DATABASE:
        raise StoredBlobError(f"blob {digest} is not in the database but {location}: read it with open_blobs")
    with open_blob(session, digest, prefetch=0) as blob:
        return bytes(blob.read(0, blob.size))


@dataclass(frozen=True)
class BlobReader:
    """An open blob: its size, and `read(offset, size)` returning that range of its bytes."""

    size: int
    read: Callable[[int, int], Buffer]  # a view is valid only while the blob is open


@contextmanager
def open_blob(
    session: Session, digest: str, *, prefetch: int = WINDOW_BYTES, store: BlobStore | None = None
) -> Iterator[BlobReader]:
    """Blob `digest` opened for reading a range at a time, so that it is never whole in memory.

    A blob in the blob store is mapped from its file (see coordinator.storage.update_files). In the
    database, SQLite reads its parts straight from the database file (incremental blob I/O);
    PostgreSQL fetches at least `prefetch` bytes per query. Valid inside `session`'s transaction.
    """
    connection = session.connection()
    row = session.execute(select(Blob.size, Blob.location, Blob.checksums).where(Blob.sha256 == digest)).first()
    if row is None:
        raise NotFound(f"blob {digest}")
    size, location, checksums = row
    if location != BlobLocation.DATABASE:
        with _stored(store, digest, size, location, checksums) as reader:
            yield reader
    elif connection.dialect.name == "sqlite":
        with ExitStack() as stack:
            dbapi = connection.connection.dbapi_connection
            yield _checked(digest, size, sqlite_part_reader(dbapi, digest, stack.enter_context))
    else:
        parts = PartedReader(
            postgres_part_lengths(session, digest),
            lambda seq, offset, length: postgres_part_range(session, digest, seq, offset, length),
        )
        yield BlobReader(_checked(digest, size, parts).size, _Window(parts.read, prefetch).read)


def _checked(digest: str, size: int, parts: PartedReader) -> BlobReader:
    """`parts` as a BlobReader, once their lengths add up to the blob's size (else the database lost a part)."""
    if parts.size != size:
        raise StoredBlobError(f"blob {digest} has {parts.size} of its {size} bytes in the database")
    return BlobReader(size, parts.read)


@contextmanager
def _stored(
    store: BlobStore | None, digest: str, size: int, location: str, checksums: bytes | None
) -> Iterator[BlobReader]:
    """A blob whose row says it is in the blob store, mapped from there."""
    if location == BlobLocation.RELEASED:
        raise StoredBlobError(f"update {digest} was released after its round (the study keeps no updates)")
    if store is None:
        raise StoredBlobError(f"blob {digest} is in the blob store, but this coordinator has none configured")
    reader = store.open(digest, size, checksums or b"")
    try:
        yield BlobReader(size, reader.read)
    finally:
        reader.close()


class _Window:
    """Serves ranges from windows of at least `prefetch` bytes, each fetched with one `fetch(offset, length)`."""

    def __init__(self, fetch: Callable[[int, int], Buffer], prefetch: int) -> None:
        self.fetch, self.prefetch = fetch, prefetch
        self.start, self.data = 0, memoryview(b"")

    def read(self, offset: int, length: int) -> memoryview:
        if not (self.start <= offset and offset + length <= self.start + len(self.data)):
            self.start, self.data = offset, memoryview(self.fetch(offset, max(length, self.prefetch)))
        begin = offset - self.start
        return self.data[begin : begin + length]


@contextmanager
def open_blobs(
    engine: Engine, digests: Sequence[str], *, prefetch: int = WINDOW_BYTES, store: BlobStore | None = None
) -> Iterator[list[BlobReader]]:
    """Blobs `digests` opened for reading a range at a time (see open_blob), without taking a write lock.

    On SQLite they are read outside any transaction on a pooled connection, each blob handle on a
    WAL snapshot of its own, so the reads neither wait for nor block a writer (this module's
    sessions begin IMMEDIATE) and several threads may read at once, each with its own call. On
    PostgreSQL they are read in a session of their own. Blobs in `store` are mapped from their files.
    """
    if engine.dialect.name != "sqlite":
        with Session(engine) as session, ExitStack() as stack:
            yield [
                stack.enter_context(open_blob(session, digest, prefetch=prefetch, store=store)) for digest in digests
            ]
        return
    connection = engine.raw_connection()
    try:
        dbapi = connection.dbapi_connection
        with ExitStack() as stack:
            readers = []
            for digest in digests:
                query = f"SELECT size, location, checksums FROM {Blob.__tablename__} WHERE sha256 = ?"
                row = dbapi.execute(query, (digest,)).fetchone()  # type: ignore[union-attr]
                if row is None:
                    raise NotFound(f"blob {digest}")
                size, location, checksums = row
                if location != BlobLocation.DATABASE:
                    readers.append(stack.enter_context(_stored(store, digest, size, location, checksums)))
                    continue
                readers.append(_checked(digest, size, sqlite_part_reader(dbapi, digest, stack.enter_context)))
            yield readers
    finally:
        connection.close()  # back to the pool


def read_range(engine: Engine, digest: str, offset: int, length: int) -> bytes | bytearray:
    """`length` bytes of database blob `digest` from `offset`, in a read that takes no write lock (see open_blobs)."""
    with open_blobs(engine, [digest], prefetch=0) as (blob,):
        data = blob.read(offset, length)
        return data if isinstance(data, bytes | bytearray) else bytes(data)


def blob_chunks(engine: Engine, digest: str, end: int, *, start: int = 0) -> Iterator[bytes | memoryview]:
    """Bytes `start` to `end` (excluded) of blob `digest` as CHUNK_BYTES chunks, each read on its own (see read_range).

    Blobs never change, so the chunks of separate reads fit together, and nothing is held while a
    chunk travels to a slow client.
    """
    for offset in range(start, end, CHUNK_BYTES):
        chunk = read_range(engine, digest, offset, min(CHUNK_BYTES, end - offset))
        if not chunk:
            raise NotFound(f"blob {digest} ends before byte {offset}")
        yield chunk if isinstance(chunk, bytes) else memoryview(chunk)


def blob_store_of(session: Session) -> BlobStore | None:
    """The blob store of the sessionmaker that made `session`: where uploaded updates are kept, if anywhere."""
    return session.info.get(BLOB_STORE)
