"""The file blob store: atomic, content-addressed writes, and reads that catch a missing or damaged file."""

import hashlib
import os
import struct
import time
from pathlib import Path

import pytest
import xxhash

from coordinator.storage.blob_store import BLOCK_BYTES, FileBlobStore, IncomingBlob, StoredBlobError


def block_checksums(data: bytes) -> bytes:
    """The oracle: xxh3-64 of each whole block of `data`, packed little-endian."""
    return b"".join(
        struct.pack("<Q", xxhash.xxh3_64_intdigest(data[offset : offset + BLOCK_BYTES]))
        for offset in range(0, len(data), BLOCK_BYTES)
    )


SIZES = [0, 1, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES - 5]


def _received(store: FileBlobStore, data: bytes, chunk: int = 65_537) -> IncomingBlob:
    """`data` arriving in chunks of an odd size, as an upload does."""
    incoming = store.incoming()
    for offset in range(0, len(data), chunk):
        incoming.write(data[offset : offset + chunk])
    incoming.finish()
    return incoming


@pytest.mark.parametrize("size", SIZES)
def test_an_upload_is_hashed_as_it_arrives(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    with _received(FileBlobStore(tmp_path), data) as incoming:
        assert incoming.size == size
        assert incoming.sha256 == hashlib.sha256(data).hexdigest()
        assert incoming.checksums == block_checksums(data)
        assert len(incoming.checksums) == 8 * -(-size // BLOCK_BYTES)
        with incoming.mapped() as view:
            assert bytes(view) == data


def test_adding_links_the_file_under_its_digest_and_leaves_no_partial_file(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    data = os.urandom(BLOCK_BYTES + 123)
    for _ in range(2):  # equal bytes twice: one file, unchanged
        with _received(store, data) as incoming:
            store.add(incoming)
            digest = incoming.sha256
    path = store.path(digest)
    assert path == tmp_path.resolve() / digest[:2] / digest
    assert path.read_bytes() == data
    assert list(store.digests()) == [digest]
    assert list((tmp_path / "incoming").iterdir()) == []  # the partial file went with the upload
    with store.open(digest, len(data), block_checksums(data)) as blob:
        assert bytes(blob.read(0, len(data))) == data


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_copy_is_replaced_by_the_new_bytes(tmp_path: Path, damage: str) -> None:
    store = FileBlobStore(tmp_path)
    data = os.urandom(5000)
    with _received(store, data) as incoming:
        digest = incoming.sha256
        store.path(digest).parent.mkdir()
        leftover = data[:100] if damage == "truncated" else bytes([data[0] ^ 1]) + data[1:]  # same size
        store.path(digest).write_bytes(leftover)
        store.add(incoming)
    assert store.path(digest).read_bytes() == data


def test_reads_are_views_and_each_block_is_checked_before_use(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    data = os.urandom(3 * BLOCK_BYTES + 10)
    with _received(store, data) as incoming:
        store.add(incoming)
        digest, checksums = incoming.sha256, incoming.checksums
    path = store.path(digest)
    damaged = bytearray(data)
    damaged[2 * BLOCK_BYTES + 7] ^= 0x01  # one bit in the third block
    path.write_bytes(damaged)
    with store.open(digest, len(data), checksums) as blob:
        assert isinstance(blob.read(0, 10), memoryview)
        assert bytes(blob.read(5, 2 * BLOCK_BYTES - 5)) == data[5 : 2 * BLOCK_BYTES]  # blocks 0 and 1 are sound
        with pytest.raises(StoredBlobError, match="block 2 does not match"):
            blob.read(2 * BLOCK_BYTES - 1, 2)  # touches block 2
        with pytest.raises(StoredBlobError, match="block 2"):
            blob.read(3 * BLOCK_BYTES - 1, 1)
        assert bytes(blob.read(3 * BLOCK_BYTES, 100)) == data[3 * BLOCK_BYTES :]  # the end, short


def test_a_missing_or_truncated_file_or_wrong_checksums_are_refused_at_open(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    data = os.urandom(2 * BLOCK_BYTES)
    with _received(store, data) as incoming:
        store.add(incoming)
        digest, checksums = incoming.sha256, incoming.checksums
    with pytest.raises(StoredBlobError, match="has 2097152 bytes, not 2097153"):
        store.open(digest, len(data) + 1, checksums)
    with pytest.raises(StoredBlobError, match="checksum bytes"):
        store.open(digest, len(data), checksums[:8])
    store.delete(digest)
    store.delete(digest)  # deleting what is gone is fine
    with pytest.raises(StoredBlobError, match="missing"):
        store.open(digest, len(data), checksums)


@pytest.mark.parametrize("digest", ["../../etc/passwd", "A" * 64, "0" * 63, "g" * 64, "0" * 64 + "/x"])
def test_only_a_sha256_names_a_file(tmp_path: Path, digest: str) -> None:
    with pytest.raises(ValueError, match="sha256"):
        FileBlobStore(tmp_path).path(digest)


def test_a_sweep_removes_only_old_partial_uploads(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    old, fresh = store.incoming(), store.incoming()
    old.write(b"cut off by a crash")
    assert old.path is not None and fresh.path is not None
    hour_ago = time.time() - 3600
    os.utime(old.path, (hour_ago, hour_ago))
    assert store.sweep_incoming(older_than_s=600) == 1
    assert not old.path.exists() and fresh.path.exists()
    old.discard()
    fresh.discard()


def test_an_unnamed_spool_cannot_be_added_to_a_store(tmp_path: Path) -> None:
    with IncomingBlob(tmp_path / "spool", named=False) as incoming:
        incoming.write(b"x")
        with pytest.raises(ValueError, match="unnamed"):
            FileBlobStore(tmp_path / "store").add(incoming)
    assert list((tmp_path / "spool").iterdir()) == []
