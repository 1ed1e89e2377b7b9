"""Blobs in the database as ordered parts: cut, stored, read across part boundaries, served, and found whole."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import Engine, delete, func, select
from sqlalchemy.orm import Session

from coordinator.db import make_engine
from coordinator.models import BlobPart, GlobalModel
from coordinator.storage import blob_parts
from coordinator.storage.blob_parts import part_rows
from coordinator.storage.blobs import blob_chunks, open_blob, open_blobs, put_blob, read_blob, read_range, sha256_of
from coordinator.storage.update_files import StoredBlobError
from shared.tensors.codec import dump, dump_pieces
from tests.coordinator.factories import ADMIN, running_study

PART = 1000  # bytes per part in these tests: a blob of a few KB spans several parts


@pytest.fixture()
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(blob_parts, "PART_BYTES", PART)
    return PART


@pytest.fixture()
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _pieces() -> list[bytes]:
    """Pieces whose edges fall before, on and after part edges: 10 bytes, 990 (to the edge), 2500, 1, 3."""
    data = bytes(range(256)) * 20
    return [data[:10], data[10:1000], data[1000:3500], data[3500:3501], data[3501:3504]]


def test_parts_are_full_but_the_last_and_copy_only_what_spans_pieces() -> None:
    pieces = _pieces()
    parts = list(part_rows(pieces, PART))
    assert b"".join(bytes(part) for part in parts) == b"".join(pieces)
    assert [len(part) for part in parts] == [1000, 1000, 1000, 504]
    assert isinstance(parts[1], memoryview)  # bytes 1000-2000 lie within the third piece: a view, no copy
    assert isinstance(parts[0], bytearray)  # the first part spans two pieces: copied into one part's buffer
    assert list(part_rows([b"", b""], PART)) == []  # an empty blob has no part


def test_a_blob_stored_from_pieces_reads_back_across_part_edges(engine: Engine, small_parts: int) -> None:
    pieces = _pieces()
    data = b"".join(pieces)
    with Session(engine) as session:
        digest = put_blob(session, pieces)
        assert put_blob(session, data) == digest  # the same bytes again: no second copy of the parts
        session.commit()
        counted = session.scalar(select(func.count()).select_from(BlobPart).where(BlobPart.sha256 == digest))
        assert digest == sha256_of(data) and counted == 4
        assert read_blob(session, digest) == data
        with open_blob(session, digest, prefetch=0) as blob:
            for offset, length in [(0, 8), (990, 20), (999, 1), (1000, 1000), (500, 2600), (3400, 200)]:
                assert bytes(blob.read(offset, length)) == data[offset : offset + length], (offset, length)
        with open_blob(session, digest, prefetch=64) as blob:  # PostgreSQL windows of at least 64 bytes
            assert bytes(blob.read(1990, 30)) + bytes(blob.read(2020, 5)) == data[1990:2025]
    with open_blobs(engine, [digest, digest]) as (first, second):
        assert first.size == second.size == len(data)
        assert bytes(first.read(2999, 2)) == data[2999:3001]
    assert bytes(read_range(engine, digest, 0, len(data))) == data
    assert b"".join(bytes(chunk) for chunk in blob_chunks(engine, digest, len(data), start=7)) == data[7:]


def test_a_blob_missing_a_part_is_refused_not_served_short(engine: Engine, small_parts: int) -> None:
    data = bytes(range(256)) * 10
    with Session(engine) as session:
        digest = put_blob(session, data)
        session.execute(delete(BlobPart).where(BlobPart.sha256 == digest, BlobPart.seq == 1))
        session.commit()
        with pytest.raises(StoredBlobError, match="1560 of its 2560 bytes"):
            read_blob(session, digest)


def test_pieces_of_a_model_store_the_bytes_dump_gives() -> None:
    tensors = {"w": torch.arange(300, dtype=torch.float32).reshape(30, 10), "b": torch.ones(7, dtype=torch.int64)}
    assert b"".join(dump_pieces(tensors, {"round": "1"})) == dump(tensors, {"round": "1"})


def test_a_global_model_of_many_parts_downloads_whole_and_by_range(client: TestClient, small_parts: int) -> None:
    study_id, headers = running_study(client, sites=("lyon",))
    models = client.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()["data"]
    url = f"/api/v1/studies/{study_id}/models/0"
    whole = client.get(url, headers=headers["lyon"])
    assert whole.status_code == 200, whole.text
    assert len(whole.content) > 5 * PART and hashlib.sha256(whole.content).hexdigest() == models[0]["sha256"]
    for start, end in [
        (PART - 3, PART + 3),
        (2 * PART, 4 * PART - 1),
        (len(whole.content) - 10, len(whole.content) - 1),
    ]:
        part = client.get(url, headers={**headers["lyon"], "Range": f"bytes={start}-{end}"})
        assert part.status_code == 206 and part.content == whole.content[start : end + 1], (start, end)


def test_global_models_are_stored_in_parts_no_larger_than_the_limit(client: TestClient, small_parts: int) -> None:
    running_study(client, sites=("lyon",))
    engine = client.app.state.coordinator.engine  # type: ignore[attr-defined]
    with Session(engine) as session:
        digest = session.scalars(select(GlobalModel.sha256)).first()
        lengths = session.scalars(
            select(func.length(BlobPart.data)).where(BlobPart.sha256 == digest).order_by(BlobPart.seq)
        ).all()
    assert len(lengths) > 5 and max(lengths) == PART and 0 < lengths[-1] <= PART
