"""The store's files: each AES-256-GCM sealed to its place (site, study, round, kind), written atomically.

Every file is `MAGIC | nonce (12 bytes) | ciphertext+tag`; the associated data binds the site,
the study, the round and the record kind, so a file moved to another study, site or round fails
to decrypt (TamperedFile). A file is written to a temporary name, fsynced, renamed into place and
its folder fsynced, so a crash leaves the old file or the new one, never a mix. A big file (a
pending upload of a gigabyte) is sealed and opened CHUNK_BYTES at a time, the same bytes as
sealing it whole, so that neither its whole plaintext joined nor its whole ciphertext is held.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "CHUNK_BYTES",
    "MAGIC",
    "NONCE_BYTES",
    "SAFE_ID",
    "SealedFiles",
    "StaleStore",
    "StoreError",
    "TamperedFile",
    "atomic_write",
    "safe_id",
]

MAGIC = b"CFLSTORE1"
NONCE_BYTES = 12
_TAG_BYTES = 16
CHUNK_BYTES = 8 << 20  # a big file is sealed, written, read and opened this many bytes at a time
Buffer = bytes | bytearray | memoryview
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a site, study or record name in a file's name


class StoreError(RuntimeError):
    """The local store cannot be used; the agent must stop rather than overwrite anything."""


class TamperedFile(StoreError):
    """A store file failed authentication: edited, truncated, or copied from elsewhere."""


class StaleStore(StoreError):
    """An older copy of the store was restored: approvals revoked since, or a secure-aggregation ledger behind."""


def safe_id(value: str, what: str) -> str:
    """`value`, when it may name a file (SAFE_ID); ValueError naming `what` otherwise."""
    if not SAFE_ID.match(value):
        raise ValueError(f"{what} id {value!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    return value


def atomic_write(path: Path, data: Buffer | Iterable[Buffer]) -> None:
    """Write `data` (or its pieces in turn) to `path` (mode 0600) so that a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            for piece in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
                handle.write(piece)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class SealedFiles:
    """One site's sealing: the key and the associated data every file of its store is bound to."""

    def __init__(self, key: bytes, site: str) -> None:
        self.site = site
        self._key = key
        self._aead = AESGCM(key)

    def place(self, kind: str, study: str = "", round_: int = -1) -> bytes:
        """The associated data of a file of `kind` (of `study`, of `round_`): where it belongs."""
        return f"cardiofl-store/v1|site={self.site}|study={study}|round={round_}|kind={kind}".encode()

    def seal(self, plain: bytes, place: bytes) -> bytes:
        """`plain` encrypted and bound to `place`, as a file's bytes."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, plain, place)

    def seal_to(self, path: Path, pieces: Iterable[Buffer], place: bytes) -> None:
        """`pieces`, joined, sealed to `place` and written atomically to `path`, CHUNK_BYTES at a time.

        The file holds the bytes `seal` gives for the joined pieces (AES-GCM over them as one
        message); only one chunk of ciphertext is held at a time.
        """
        nonce = secrets.token_bytes(NONCE_BYTES)
        encryptor = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(place)

        def sealed() -> Iterator[bytes]:
            yield MAGIC + nonce
            for piece in pieces:
                view = memoryview(piece).cast("B")
                for start in range(0, len(view), CHUNK_BYTES):
                    yield encryptor.update(view[start : start + CHUNK_BYTES])
            yield encryptor.finalize() + encryptor.tag

        atomic_write(path, sealed())

    def open_chunks(self, path: Path, place: bytes) -> Iterator[bytes]:
        """The plaintext of the file at `path`, bound to `place`, CHUNK_BYTES at a time.

        Authentication ends with the last chunk: TamperedFile is raised then (or earlier, for a bad
        header), so nothing of the chunks may be used before the iteration has ended.
        """
        start, size = len(MAGIC) + NONCE_BYTES, path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(start)
            if not head.startswith(MAGIC) or size < start + _TAG_BYTES:
                raise TamperedFile(f"{path} is not a cardiofl store file (bad header or truncated)")
            handle.seek(size - _TAG_BYTES)
            tag = handle.read(_TAG_BYTES)
            handle.seek(start)
            decryptor = Cipher(algorithms.AES(self._key), modes.GCM(head[len(MAGIC) :], tag)).decryptor()
            decryptor.authenticate_additional_data(place)
            left = size - start - _TAG_BYTES
            while left > 0:
                chunk = handle.read(min(CHUNK_BYTES, left))
                if not chunk:
                    raise TamperedFile(f"{path} is not a cardiofl store file (truncated)")
                left -= len(chunk)
                yield decryptor.update(chunk)
        try:
            decryptor.finalize()
        except InvalidTag:
            raise TamperedFile(f"{path} failed authentication: it was modified, truncated or moved") from None

    @staticmethod
    def plain_size(path: Path) -> int:
        """How many bytes of plaintext the sealed file at `path` holds."""
        return max(0, path.stat().st_size - len(MAGIC) - NONCE_BYTES - _TAG_BYTES)

    def open(self, path: Path, place: bytes) -> bytes:
        """The plaintext of the file at `path`, bound to `place`; TamperedFile when it is not."""
        blob = path.read_bytes()
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + NONCE_BYTES + _TAG_BYTES:
            raise TamperedFile(f"{path} is not a cardiofl store file (bad header or truncated)")
        nonce = blob[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, blob[len(MAGIC) + NONCE_BYTES :], place)
        except InvalidTag:
            raise TamperedFile(f"{path} failed authentication: it was modified, truncated or moved") from None
