"""The secure-aggregation ledger: what it keeps, and that an older copy of the store cannot make it forget."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shared.tensors.codec import content_digest
from site_agent.ledger import LEDGER, record_revealed, record_use, revealed_attempt, used_from
from site_agent.store import SiteStore, StaleStore, generate_key

DIGEST = "d" * 64


@pytest.fixture()
def key() -> bytes:
    return generate_key()


def open_store(root: Path, key: bytes) -> SiteStore:
    return SiteStore(root, key, "lyon", version_file=root.with_name("store.approvals-version"))


def restore(copy: Path, root: Path) -> None:
    shutil.rmtree(root)
    shutil.copytree(copy, root)


def test_the_ledger_keeps_each_use_and_reveal_encrypted(tmp_path: Path, key: bytes) -> None:
    root = tmp_path / "store"
    store = open_store(root, key)
    assert used_from(store, DIGEST) is None and revealed_attempt(store, "1-u", 3) is None
    record_use(store, "1-u", 3, DIGEST)
    record_use(store, "1-u", 3, DIGEST)  # the same round again (a retry, a restart): nothing changes
    record_revealed(store, "1-u", 3, 2)
    store = open_store(root, key)
    assert used_from(store, DIGEST) == ("1-u", 3) and revealed_attempt(store, "1-u", 3) == 2
    assert revealed_attempt(store, "1-u", 4) is None and revealed_attempt(store, "2-u", 3) is None
    raw = (root / f"protected-{LEDGER}.enc").read_bytes()
    assert DIGEST.encode() not in raw and b"1-u" not in raw  # AES-GCM: nothing readable
    assert store.approvals_version() == (0, [])  # the ledger has its own count: approvals are untouched


def test_a_reveal_recorded_before_the_ledger_is_still_honoured(tmp_path: Path, key: bytes) -> None:
    store = open_store(tmp_path / "store", key)
    store.save_record("revealed", {"5": 1}, "1-u")  # what releases before the ledger wrote
    assert revealed_attempt(store, "1-u", 5) == 1


@pytest.mark.parametrize("what", ["use", "reveal"])
def test_an_older_copy_of_the_store_that_forgot_a_use_or_a_reveal_is_refused(
    tmp_path: Path, key: bytes, what: str
) -> None:
    root, copy = tmp_path / "store", tmp_path / "backup"
    store = open_store(root, key)
    record_use(store, "1-u", 1, DIGEST)
    shutil.copytree(root, copy)  # the backup, taken after round 1
    if what == "use":
        record_use(store, "1-u", 2, "e" * 64)
    else:
        record_revealed(store, "1-u", 2, 1)
    restore(copy, root)  # round 2's use (or reveal) is forgotten
    with pytest.raises(StaleStore, match=r"was restored \(its secure-ledger is at count 1; .* records 2\)"):
        open_store(root, key)
    shutil.rmtree(root / "approvals")  # the approvals' remedy does not bring the ledger back
    with pytest.raises(StaleStore, match="its secure-ledger is at count 1"):
        open_store(root, key)


def test_a_store_without_its_ledger_or_its_record_is_refused(tmp_path: Path, key: bytes) -> None:
    root = tmp_path / "store"
    record_use(open_store(root, key), "1-u", 1, DIGEST)
    ledger = (root / f"protected-{LEDGER}.enc").read_bytes()
    (root / f"protected-{LEDGER}.enc").unlink()  # the ledger deleted: as if it never was
    with pytest.raises(StaleStore, match=r"its secure-ledger is at count 0; .* records 1"):
        open_store(root, key)
    (root / f"protected-{LEDGER}.enc").write_bytes(ledger)
    root.with_name("store.approvals-version").unlink()  # the record outside deleted
    with pytest.raises(StaleStore, match=r"its approvals are at version 0|its secure-ledger is at count 1"):
        SiteStore(root, key, "lyon", version_file=root.with_name("store.approvals-version"))


def test_a_crash_between_the_ledger_and_its_record_reads_as_the_store_ahead(tmp_path: Path, key: bytes) -> None:
    root = tmp_path / "store"
    record_use(open_store(root, key), "1-u", 1, DIGEST)
    record_use(SiteStore(root, key, "lyon"), "1-u", 2, "e" * 64)  # its record not moved on (no version file)
    store = open_store(root, key)  # the store is ahead: the record catches up
    assert used_from(store, "e" * 64) == ("1-u", 2)
    record_revealed(store, "1-u", 2, 1)
    assert open_store(root, key).load_protected(LEDGER) is not None


def test_the_content_digest_ignores_metadata_and_sees_every_bit() -> None:
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.tensor([1, 2], dtype=torch.int64)}
    same = {"a": tensors["a"].clone(), "b": tensors["b"].clone()}
    assert content_digest(tensors) == content_digest(same)
    flipped = {**same, "b": same["b"].clone()}
    flipped["b"].view(torch.int32)[0, 0] ^= 1  # one bit
    assert content_digest(flipped) != content_digest(tensors)
    assert content_digest({"b": tensors["b"].reshape(3, 2), "a": tensors["a"]}) != content_digest(tensors)
    assert content_digest({"c": tensors["b"], "a": tensors["a"]}) != content_digest(tensors)
