"""A pending upload is sealed and read a chunk at a time: the same file as sealing it whole, whatever the chunk size."""

from pathlib import Path

import pytest
import torch

import site_agent.store_files
from site_agent.store import PendingUpdate, SiteStore, StoreError, TamperedFile, generate_key


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_a_pending_upload_round_trips_and_commits_across_chunks(tmp_path: Path, monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(site_agent.store_files, "CHUNK_BYTES", chunk)
    store = SiteStore(tmp_path, generate_key(), "site-a")
    upload = bytes(range(256)) * 5
    local = {"phi": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    store.save_pending("study1", PendingUpdate(4, upload, local, {"round_id": 9}))
    path = tmp_path / "studies" / "study1" / "pending.enc"
    whole = store._files.open(path, store._ad("pending", "study1"))  # the chunked file opens as one message
    assert upload in whole
    pending = store.load_pending("study1")
    assert pending is not None and bytes(pending.upload) == upload and pending.round == 4
    assert pending.meta == {"round_id": 9} and torch.equal(pending.local["phi"], local["phi"])
    assert store.commit_pending("study1") == 4
    committed = store.load_local("study1")
    assert committed is not None and committed[0] == 4 and torch.equal(committed[1]["phi"], local["phi"])
    assert store.load_pending("study1") is None


def test_a_pending_upload_altered_anywhere_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(site_agent.store_files, "CHUNK_BYTES", 16)
    store = SiteStore(tmp_path, generate_key(), "site-a")
    store.save_pending("study1", PendingUpdate(1, b"u" * 100, {"phi": torch.ones(2)}, {}))
    path = tmp_path / "studies" / "study1" / "pending.enc"
    sealed = path.read_bytes()
    for at in (30, len(sealed) // 2, len(sealed) - 1):  # the header, the upload, the tag
        altered = bytearray(sealed)
        altered[at] ^= 1
        path.write_bytes(bytes(altered))
        with pytest.raises(StoreError):  # TamperedFile is one
            store.load_pending("study1")
        with pytest.raises(StoreError):  # TamperedFile is one
            store.commit_pending("study1")
    path.write_bytes(sealed[:-5])
    with pytest.raises(TamperedFile):
        store.load_pending("study1")
