"""Content-addressed safetensors blobs kept in the database, keyed by their sha256."""

from __future__ import annotations

import hashlib

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from coordinator.errors import NotFound
from coordinator.models import Blob

__all__ = ["put_blob", "read_blob", "sha256_of"]


def sha256_of(data: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def put_blob(session: Session, data: bytes | bytearray, digest: str | None = None) -> str:
    """Store `data` unless a blob with its digest exists (two writers of equal bytes both succeed)."""
    digest = digest or sha256_of(data)
    values = {"sha256": digest, "size": len(data), "data": data}
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    session.execute(insert(Blob).values(**values).on_conflict_do_nothing(index_elements=["sha256"]))
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
