"""Content-addressed safetensors blobs, keyed by their sha256; read whole or a range at a time.

Global models (theta^g_t, phi_0) are kept in the database. Uploaded updates are kept in the blob
store (coordinator.storage.update_files) when one is configured, the database row holding their digest,
size and block checksums; without a store, or in a database from before the store, they are in
the database too. Readers find a blob wherever its row says it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, literal_column, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import ColumnClause

from coordinator.db import BLOB_STORE
from coordinator.errors import NotFound
from coordinator.models import Blob, BlobLocation
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


def put_blob(session: Session, data: bytes | bytearray | memoryview, digest: str | None = None) -> str:
    """Store `data` in the database unless a blob with its digest exists (two writers of equal bytes both succeed).

    One INSERT with the bytes bound: the driver holds one transient copy while it runs, and the
    bytes are written once (an empty row filled by incremental blob I/O writes every page twice,
    which took 1.3-1.5x as long for a 94 MB model).
    """
    digest = digest or sha256_of(data)
    insert = postgresql.insert(Blob) if session.get_bind().dialect.name == "postgresql" else sqlite.insert(Blob)
    values = {"sha256": digest, "size": len(data), "data": data}
    session.execute(insert.values(**values).on_conflict_do_nothing(index_elements=["sha256"]))
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
    row = {"sha256": digest, "size": len(data), "data": b"", "location": BlobLocation.STORE}
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
    """The bytes of blob `digest`, kept in the database (a blob in the blob store is read with open_blobs)."""
    location = session.scalar(select(Blob.location).where(Blob.sha256 == digest))
    if location is not None and location != BlobLocation.DATABASE:
        raise StoredBlobError(f"blob {digest} is not in the database but {location}: read it with open_blobs")
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
    read: Callable[[int, int], bytes | memoryview]  # a view is valid only while the blob is open


@contextmanager
def open_blob(
    session: Session, digest: str, *, prefetch: int = WINDOW_BYTES, store: BlobStore | None = None
) -> Iterator[BlobReader]:
    """Blob `digest` opened for reading a range at a time, so that it is never whole in memory.

    A blob in the blob store is mapped from its file (see coordinator.storage.update_files). In the database,
    SQLite reads straight from the database file (incremental blob I/O); PostgreSQL fetches at
    least `prefetch` bytes per query; other databases read the blob whole. Valid inside `session`'s
    transaction.
    """
    connection = session.connection()
    sqlite_file = connection.dialect.name == "sqlite"
    rowid: ColumnClause[Any] = literal_column("rowid") if sqlite_file else literal_column("NULL")
    row = session.execute(
        select(rowid, Blob.size, Blob.location, Blob.checksums).select_from(Blob).where(Blob.sha256 == digest)
    ).first()
    if row is None:
        raise NotFound(f"blob {digest}")
    rowid_value, size, location, checksums = row
    if location != BlobLocation.DATABASE:
        with _stored(store, digest, size, location, checksums) as reader:
            yield reader
    elif sqlite_file:
        dbapi = connection.connection.dbapi_connection
        with dbapi.blobopen(Blob.__tablename__, "data", rowid_value, readonly=True) as handle:  # type: ignore[union-attr]
            yield BlobReader(size, _slicer(handle))
    elif connection.dialect.driver == "psycopg":
        yield BlobReader(size, _PostgresWindow(session, digest, prefetch).read)
    else:
        data = read_blob(session, digest)
        yield BlobReader(len(data), lambda offset, length: data[offset : offset + length])


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
                query = f"SELECT rowid, size, location, checksums FROM {Blob.__tablename__} WHERE sha256 = ?"
                row = dbapi.execute(query, (digest,)).fetchone()  # type: ignore[union-attr]
                if row is None:
                    raise NotFound(f"blob {digest}")
                rowid, size, location, checksums = row
                if location != BlobLocation.DATABASE:
                    readers.append(stack.enter_context(_stored(store, digest, size, location, checksums)))
                    continue
                handle = stack.enter_context(dbapi.blobopen(Blob.__tablename__, "data", rowid, readonly=True))  # type: ignore[union-attr]
                readers.append(BlobReader(size, _slicer(handle)))
            yield readers
    finally:
        connection.close()  # back to the pool


def _slicer(handle: Any) -> Callable[[int, int], bytes]:
    """`read(offset, length)` over an open SQLite blob handle."""
    return lambda offset, length: handle[offset : offset + length]


def read_range(engine: Engine, digest: str, offset: int, length: int) -> bytes:
    """`length` bytes of database blob `digest` from `offset`, in a read that takes no write lock (see open_blobs)."""
    with open_blobs(engine, [digest], prefetch=0) as (blob,):
        return bytes(blob.read(offset, length))


def blob_chunks(engine: Engine, digest: str, end: int, *, start: int = 0) -> Iterator[bytes]:
    """Bytes `start` to `end` (excluded) of blob `digest` as CHUNK_BYTES chunks, each read on its own (see read_range).

    Blobs never change, so the chunks of separate reads fit together, and nothing is held while a
    chunk travels to a slow client.
    """
    for offset in range(start, end, CHUNK_BYTES):
        chunk = read_range(engine, digest, offset, min(CHUNK_BYTES, end - offset))
        if not chunk:
            raise NotFound(f"blob {digest} ends before byte {offset}")
        yield chunk


def blob_store_of(session: Session) -> BlobStore | None:
    """The blob store of the sessionmaker that made `session`: where uploaded updates are kept, if anywhere."""
    return session.info.get(BLOB_STORE)
