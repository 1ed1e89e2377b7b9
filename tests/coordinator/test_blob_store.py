"""The file blob store: atomic, content-addressed writes, and reads that catch a missing or damaged file."""

import hashlib
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import xxhash

from coordinator.storage.update_files import BLOCK_BYTES, FileBlobStore, IncomingBlob, StoredBlobError
from coordinator.storage.upload_sessions import SessionKey, UploadSessions


def block_checksums(data: bytes) -> bytes:
    """The oracle: xxh3-64 of each whole block of `data`, packed little-endian."""
    return b"".join(
        struct.pack("<Q", xxhash.xxh3_64_intdigest(data[offset : offset + BLOCK_BYTES]))
        for offset in range(0, len(data), BLOCK_BYTES)
    )


@pytest.fixture(autouse=True)
def roomy_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system with room for spares, whatever this machine's disk holds (one test makes it full)."""
    from coordinator.storage import update_files as blob_store

    real = shutil.disk_usage
    monkeypatch.setattr(blob_store.shutil, "disk_usage", lambda path: real(path)._replace(free=real(path).total))


SIZES = [0, 1, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES - 5]


def _received(store: FileBlobStore, data: bytes, chunk: int = 65_537) -> IncomingBlob:
    """`data` arriving in chunks of an odd size, as an upload does (its Content-Length known)."""
    incoming = store.incoming(len(data))
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


def _stored(store: FileBlobStore, data: bytes) -> str:
    with _received(store, data) as incoming:
        store.add(incoming)
        return incoming.sha256


def test_a_released_file_is_written_over_by_the_next_upload_and_keeps_nothing_of_what_it_held(
    tmp_path: Path,
) -> None:
    store = FileBlobStore(tmp_path, spare_bytes=10 * BLOCK_BYTES)
    old = os.urandom(2 * BLOCK_BYTES)
    old_digest = _stored(store, old)
    inode = store.path(old_digest).stat().st_ino
    store.delete(old_digest)
    assert not store.path(old_digest).exists() and list(store.digests()) == []
    [spare] = (tmp_path / "spare").iterdir()
    assert spare.stat().st_ino == inode and spare.read_bytes() == old
    new = os.urandom(2 * BLOCK_BYTES - 1000)  # a little shorter: the spare's tail must go
    with _received(store, new) as incoming:
        store.add(incoming)
        new_digest = incoming.sha256
        assert (incoming.size, incoming.checksums) == (len(new), block_checksums(new))
    assert store.path(new_digest).stat().st_ino == inode  # the same file, its cached pages reused
    assert store.path(new_digest).read_bytes() == new and new_digest == hashlib.sha256(new).hexdigest()
    assert list((tmp_path / "spare").iterdir()) == [] and list((tmp_path / "incoming").iterdir()) == []
    with store.open(new_digest, len(new), block_checksums(new)) as blob:
        assert bytes(blob.read(0, len(new))) == new


def test_a_new_upload_session_takes_a_released_file_emptied(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path, spare_bytes=10 * BLOCK_BYTES)
    old = os.urandom(2 * BLOCK_BYTES)
    old_digest = _stored(store, old)
    inode = store.path(old_digest).stat().st_ino
    store.delete(old_digest)
    sessions = UploadSessions(tmp_path / "sessions", store)
    key = SessionKey(round_id=1, site_id=2, size=len(old), sha256="a" * 64)
    assert sessions.start(key) == (0, True)
    held = sessions.path(key)
    assert held.stat().st_ino == inode and held.stat().st_size == 0  # the spare, its old bytes gone
    assert list((tmp_path / "spare").iterdir()) == [] and sorted(p.name for p in held.parent.iterdir()) == [key.name]
    assert sessions.start(key) == (0, False)  # the same session again: no other file is taken
    other = SessionKey(round_id=1, site_id=3, size=len(old), sha256="b" * 64)
    assert sessions.start(other) == (0, True) and sessions.path(other).stat().st_size == 0  # none left: a new file


def test_spares_stay_within_their_budget_and_a_zero_budget_keeps_none(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "kept", spare_bytes=3 * BLOCK_BYTES)
    digests = [_stored(store, os.urandom(BLOCK_BYTES + n)) for n in range(4)]
    for digest in digests:
        store.delete(digest)
    spares = list((tmp_path / "kept" / "spare").iterdir())
    assert len(spares) == 2 and sum(path.stat().st_size for path in spares) <= 3 * BLOCK_BYTES
    assert list(store.digests()) == []
    unkept = FileBlobStore(tmp_path / "unkept")
    digest = _stored(unkept, os.urandom(100))
    unkept.delete(digest)
    assert not (tmp_path / "unkept" / "spare").exists() and list(unkept.digests()) == []


def test_an_upload_takes_the_spare_that_fits_it_and_leaves_a_much_larger_one(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path, spare_bytes=1 << 40)
    digests = {size: _stored(store, os.urandom(size)) for size in (8 * BLOCK_BYTES, 2 * BLOCK_BYTES, BLOCK_BYTES // 2)}
    sizes = {size: store.path(digest).stat().st_ino for size, digest in digests.items()}
    for digest in digests.values():
        store.delete(digest)

    def spare_inodes() -> set[int]:
        return {path.stat().st_ino for path in (tmp_path / "spare").iterdir()}

    store.incoming(size_hint=2 * BLOCK_BYTES - 7).discard()  # the 2-block spare; the 8-block one is too large
    assert spare_inodes() == {sizes[8 * BLOCK_BYTES], sizes[BLOCK_BYTES // 2]}
    store.incoming(size_hint=3 * BLOCK_BYTES).discard()  # none fits: the largest smaller one, to grow
    assert spare_inodes() == {sizes[8 * BLOCK_BYTES]}
    store.incoming(size_hint=100).discard()  # only a much larger one: a new file
    assert spare_inodes() == {sizes[8 * BLOCK_BYTES]}


def test_a_spare_another_worker_took_first_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileBlobStore(tmp_path, spare_bytes=1 << 30)
    digest = _stored(store, os.urandom(1000))
    store.delete(digest)
    [spare] = (tmp_path / "spare").iterdir()
    listed = store._spares_by_fit
    monkeypatch.setattr(store, "_spares_by_fit", lambda hint: [tmp_path / "spare" / "gone", *listed(hint)])
    data = os.urandom(900)
    with _received(store, data) as incoming:
        store.add(incoming)
    assert not spare.exists() and store.path(hashlib.sha256(data).hexdigest()).read_bytes() == data


def test_spares_no_upload_took_in_time_are_swept(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path, spare_bytes=1 << 30)
    for digest in [_stored(store, os.urandom(size)) for size in (100, 200)]:
        store.delete(digest)
    assert store.sweep_spares(older_than_s=3600) == 0 and len(list((tmp_path / "spare").iterdir())) == 2
    assert store.sweep_spares(older_than_s=-1) == 2 and list((tmp_path / "spare").iterdir()) == []


def test_no_spare_is_kept_on_a_disk_short_of_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.storage import update_files as blob_store

    store = FileBlobStore(tmp_path, spare_bytes=1 << 30)
    digest = _stored(store, os.urandom(1000))
    usage = blob_store.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(blob_store.shutil, "disk_usage", lambda _: usage._replace(free=usage.total // 10))
    store.delete(digest)
    assert not store.path(digest).exists() and not (tmp_path / "spare").exists()
