"""Stored updates summed window by window, side by side and in threads: the same bits as one at a time."""

import json
import struct
import threading
from pathlib import Path

import pytest
import torch
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import make_engine, make_sessionmaker
from coordinator.storage import stored_updates
from coordinator.storage.blobs import open_blobs, put_blob, put_update_blob, sha256_of
from coordinator.storage.update_files import FileBlobStore
from shared.algorithms.aggregation import WeightedAverage, weighted_average
from shared.algorithms.server import ScaffoldAggregator, next_global
from shared.tensors import windows as tensor_windows
from shared.tensors.codec import dump, read_header
from tests.conftest import create_tables


def _update(seed: int) -> dict[str, torch.Tensor]:
    """A model-like state: float runs broken by integer buffers, odd sizes, an empty tensor, a float64."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(301, 7, generator=generator),
        "a.bias": torch.randn(13, generator=generator),
        "b.num_batches_tracked": torch.tensor(seed * 3),
        "c.weight": torch.randn(999, generator=generator),
        "d.empty": torch.zeros(0, 5),
        "e.double": torch.randn(77, generator=generator, dtype=torch.float64),
        "f.half": torch.randn(55, generator=generator).half(),
    }


def _reordered(data: bytes) -> bytes:
    """The same tensors as `data`, laid out in the reverse order: a valid payload another writer could make."""
    header = read_header(data)
    names = sorted(header.offsets, key=lambda name: header.offsets[name][0], reverse=True)
    raw = json.loads(data[8 : header.data_start])
    chunks, position = [], 0
    for name in names:
        begin, end = header.offsets[name]
        chunks.append(data[header.data_start + begin : header.data_start + end])
        raw[name]["data_offsets"] = [position, position + end - begin]
        position += end - begin
    encoded = json.dumps(raw).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)


@pytest.fixture(params=["database", "blob_store"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FileBlobStore | None:
    """Where the updates are kept: in the database (no store, or a database from before it), or the blob store."""
    return FileBlobStore(tmp_path / "blobs") if request.param == "blob_store" else None


def _store(sessions: sessionmaker[Session], payloads: list[bytes], store: FileBlobStore | None = None) -> list[str]:
    with sessions() as session:
        if store is None:
            digests = [put_blob(session, payload) for payload in payloads]
        else:
            digests = [sha256_of(payload) for payload in payloads]
            for payload, digest in zip(payloads, digests, strict=True):
                put_update_blob(session, store, payload, digest)
        session.commit()
    return digests


def _assert_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), name


@pytest.mark.parametrize(("group", "workers"), [(1, 1), (2, 2), (8, 2), (3, 3)])
def test_stored_updates_sum_to_the_bits_of_one_at_a_time(
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    group: int,
    workers: int,
    store: FileBlobStore | None,
) -> None:
    monkeypatch.setattr(tensor_windows, "PIECE_BYTES", 512)  # many windows, each cut inside tensors
    monkeypatch.setattr(stored_updates, "SHARE_BYTES", 1024)  # threads even for these small updates
    threads: list[str] = []
    real_add = stored_updates._Share.add

    def add(share: stored_updates._Share, windows: list) -> None:
        threads.append(threading.current_thread().name)
        real_add(share, windows)

    monkeypatch.setattr(stored_updates._Share, "add", add)
    updates = [_update(seed) for seed in range(5)]
    weights = [0.1, 0.3, 0.2, 0.25, 0.15]
    digests = _store(sessions, [dump(update, {"site": str(k)}) for k, update in enumerate(updates)], store)
    average = WeightedAverage()
    stored_updates.add_stored_updates(
        average, sessions.kw["bind"], digests, weights, group=group, workers=workers, store=store
    )
    _assert_identical(average.result(), weighted_average(zip(updates, weights, strict=True)))
    assert average.count == 5
    # the windows were shared out among `workers` threads, each with a connection of its own
    assert len(threads) == -(-5 // group) * workers and (
        workers == 1 or all(name.startswith("aggregate") for name in threads)
    )


def test_an_update_laid_out_in_another_order_is_summed_correctly(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch, store: FileBlobStore | None
) -> None:
    monkeypatch.setattr(tensor_windows, "PIECE_BYTES", 256)
    updates = [_update(seed) for seed in range(4)]
    payloads = [dump(update) for update in updates]
    payloads[0] = _reordered(payloads[0])  # the sums take this order: the others cannot be added run-wise
    payloads[2] = _reordered(payloads[2])  # and a batch of one layout is cut short by another
    assert read_header(payloads[0]).offsets != read_header(payloads[1]).offsets
    digests = _store(sessions, payloads, store)
    weights = [0.4, 0.3, 0.2, 0.1]
    average = WeightedAverage()
    stored_updates.add_stored_updates(average, sessions.kw["bind"], digests, weights, store=store)
    _assert_identical(average.result(), weighted_average(zip(updates, weights, strict=True)))


def test_scaffold_reads_its_stored_updates_as_it_adds_them_in_memory(
    sessions: sessionmaker[Session], store: FileBlobStore | None
) -> None:
    previous = {"w": torch.randn(1000), "scaffold.c.w": torch.randn(1000)}
    updates = [{"w": torch.randn(1000), "scaffold.delta_c.w": torch.randn(1000)} for _ in range(3)]
    weights = [0.5, 0.25, 0.25]
    expected = next_global(ScaffoldAggregator(0.7, 4), previous, zip(updates, weights, strict=True))
    aggregator = ScaffoldAggregator(0.7, 4)
    engine = sessions.kw["bind"]
    stored_updates.add_stored_updates(
        aggregator.previous, engine, _store(sessions, [dump(previous)], store), [1.0], store=store
    )
    stored_updates.add_stored_updates(
        aggregator, engine, _store(sessions, [dump(u) for u in updates], store), weights, store=store
    )
    _assert_identical(aggregator.result(), expected)


def test_a_missing_blob_is_reported_and_nothing_is_counted(sessions: sessionmaker[Session]) -> None:
    average = WeightedAverage()
    with pytest.raises(Exception, match="blob"):
        stored_updates.add_stored_updates(average, sessions.kw["bind"], ["0" * 64], [1.0])
    assert average.count == 0


def test_updates_are_read_while_another_writer_holds_the_write_lock(
    sessions: sessionmaker[Session], store: FileBlobStore | None
) -> None:
    digests = _store(sessions, [dump(_update(seed)) for seed in range(3)], store)
    engine = sessions.kw["bind"]
    writer = sessions()
    writer.execute(text("UPDATE blobs SET size = size WHERE sha256 = :d"), {"d": digests[0]})  # holds the lock
    try:
        done = threading.Event()

        def read() -> None:
            stored_updates.add_stored_updates(WeightedAverage(), engine, digests, [1.0, 1.0, 1.0], store=store)
            done.set()

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=30)
        assert done.is_set(), "reading the updates waited for the writer"
    finally:
        writer.rollback()
        writer.close()


def test_a_new_sqlite_database_keeps_pointer_maps(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    create_tables(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA auto_vacuum").scalar() == 2  # incremental
    data = bytes(range(256)) * 4096
    digest = _store(make_sessionmaker(engine), [data])[0]
    with open_blobs(engine, [digest], prefetch=0) as (blob,):
        assert blob.read(700_001, 5) == data[700_001:700_006]
    engine.dispose()


def test_weights_that_do_not_sum_exactly_give_the_bits_of_one_at_a_time(
    sessions: sessionmaker[Session], store: FileBlobStore | None
) -> None:
    updates = [{"w": torch.full((4,), float(k + 1))} for k in range(9)]
    weights = [0.1] * 9  # their running sum is not fsum's: the total must be summed as `add` sums it
    digests = _store(sessions, [dump(update, {"k": str(k)}) for k, update in enumerate(updates)], store)
    average = WeightedAverage()
    stored_updates.add_stored_updates(average, sessions.kw["bind"], digests, weights, group=8, store=store)
    _assert_identical(average.result(), weighted_average(zip(updates, weights, strict=True)))


def test_a_sqlite_database_cuts_its_write_ahead_log_back_after_checkpoints(tmp_path: Path) -> None:
    from coordinator.db import WAL_SIZE_LIMIT_BYTES

    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    create_tables(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    _store(sessions, [bytes([k]) * (40 << 20) for k in range(2)])  # 80 MB through the log
    raw = engine.raw_connection()  # outside any transaction, as SQLite's own checkpoints run
    try:
        assert raw.dbapi_connection.execute("PRAGMA journal_size_limit").fetchone()[0] == WAL_SIZE_LIMIT_BYTES
        assert (tmp_path / "coordinator.db-wal").stat().st_size > 80 << 20  # the log as large as it grew
        raw.dbapi_connection.execute("PRAGMA wal_checkpoint(PASSIVE)")
    finally:
        raw.close()
    _store(sessions, [b"small"])  # the next write after a checkpoint restarts the log and truncates it
    wal = tmp_path / "coordinator.db-wal"
    assert wal.stat().st_size <= WAL_SIZE_LIMIT_BYTES
    engine.dispose()


def test_stored_tensors_read_one_tensor_at_a_time_across_part_edges(
    sessions: sessionmaker[Session], store: FileBlobStore | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.storage import blob_parts
    from coordinator.storage.stored_tensors import StoredTensors

    monkeypatch.setattr(blob_parts, "PART_BYTES", 1000)  # the database keeps the blob in parts of 1,000 bytes
    tensors = _update(5)
    [digest] = _store(sessions, [dump(tensors)], store)
    engine = sessions.kw["bind"]
    with open_blobs(engine, [digest], store=store, prefetch=64) as (blob,):
        stored = StoredTensors(blob)
        assert list(stored) == list(read_header(dump(tensors)).specs) and len(stored) == len(tensors)
        read = {name: stored[name] for name in reversed(list(stored))}  # in any order, each on its own
        for name, tensor in tensors.items():  # and a window of one, read alone: the flat slice, fewer at its end
            for start, stop in [(0, 1), (3, 250), (200, 10_000), (tensor.numel(), tensor.numel() + 5)]:
                assert torch.equal(stored.window(name, start, stop), tensor.reshape(-1)[start:stop])
        with pytest.raises(KeyError):
            stored["phi.absent"]
    _assert_identical(read, tensors)  # each tensor owns its bytes: valid once the blob is closed
