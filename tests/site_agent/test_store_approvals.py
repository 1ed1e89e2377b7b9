"""The store's approvals' version: an older copy of the store, restored, must not approve again what was revoked."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from site_agent import store as store_module
from site_agent.store import APPROVALS_STATE, SiteStore, StaleStore, TamperedFile, generate_key

APPROVAL = {"digest": "d" * 64, "approved_by": "operator"}


@pytest.fixture()
def key() -> bytes:
    return generate_key()


def open_store(root: Path, key: bytes, record: Path | None = None) -> SiteStore:
    """Site lyon's store, checked against `record` (default: beside the store, as with a key from the environment)."""
    return SiteStore(root, key, "lyon", version_file=record or root.with_name("store.approvals-version"))


def files_of(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.enc")}


def restore(copy: Path, root: Path) -> None:
    shutil.rmtree(root)
    shutil.copytree(copy, root)


def test_a_fresh_store_opens_and_records_version_0_outside(tmp_path: Path, key: bytes) -> None:
    store = open_store(tmp_path / "store", key)
    assert store.approvals_version() == (0, []) and store.recorded_version() == 0
    assert (tmp_path / "store.approvals-version").is_file() and (
        tmp_path / "store" / "approvals" / APPROVALS_STATE
    ).is_file()
    assert store.approved_studies() == []  # the state file is no study's approval
    assert open_store(tmp_path / "store", key).approvals_version() == (0, [])


def test_approve_and_revoke_cycles_move_the_version_on_in_the_store_and_outside(tmp_path: Path, key: bytes) -> None:
    root = tmp_path / "store"
    store = open_store(root, key)
    for cycle in range(3):
        store.save_approval("1-u", APPROVAL)
        store.save_approval("2-u", APPROVAL)
        assert store.remove_approval("1-u") and not store.remove_approval("9-u")
        store = open_store(root, key)  # every start checks the store against the record
        assert store.approvals_version() == (5 * cycle + 4, ["2-u"]) == (store.recorded_version(), ["2-u"])
        assert store.load_approval("2-u") == APPROVAL and store.load_approval("1-u") is None
        assert store.remove_approval("2-u")
        store = open_store(root, key)
    assert store.approvals_version() == (15, []) and store.approved_studies() == []


def test_an_older_copy_of_the_store_restored_after_a_revocation_is_refused(tmp_path: Path, key: bytes) -> None:
    root, copy = tmp_path / "store", tmp_path / "backup"
    store = open_store(root, key)
    store.save_approval("1-u", APPROVAL)
    shutil.copytree(root, copy)  # the backup, taken while study 1 was approved
    store.remove_approval("1-u")
    restore(copy, root)  # the revoked approval is back
    before = files_of(root)
    with pytest.raises(StaleStore, match=r"an older copy of the store at .* was restored \(.*version 1; .* records 2"):
        open_store(root, key)
    assert files_of(root) == before  # refused without touching the store
    shutil.rmtree(root / "approvals")  # what the error tells the operator: drop the approvals, approve again
    store = open_store(root, key)
    assert store.approved_studies() == [] and store.approvals_version() == (2, [])  # the count goes on
    store.save_approval("1-u", APPROVAL)
    assert open_store(root, key).recorded_version() == 3


def test_a_restored_approval_file_that_the_version_does_not_list_is_refused(tmp_path: Path, key: bytes) -> None:
    root = tmp_path / "store"
    store = open_store(root, key)
    store.save_approval("1-u", APPROVAL)
    store.save_approval("2-u", APPROVAL)
    kept = (root / "approvals" / "2-u.enc").read_bytes()
    store.remove_approval("2-u")
    (root / "approvals" / "2-u.enc").write_bytes(kept)  # one file restored from a backup: the version is current
    with pytest.raises(StaleStore, match=r"approvals of 2-u are not in its version 3"):
        open_store(root, key)


def test_without_the_record_a_store_whose_approvals_moved_on_is_refused(tmp_path: Path, key: bytes) -> None:
    root, record = tmp_path / "store", tmp_path / "keys" / "store.key.approvals-version"
    record.parent.mkdir()
    open_store(root, key, record).save_approval("1-u", APPROVAL)
    record.unlink()
    with pytest.raises(StaleStore, match=r"version 1; .*store.key.approvals-version is missing"):
        open_store(root, key, record)
    moved = tmp_path / "elsewhere" / "store"  # a store without approvals never needs the record
    assert open_store(moved, key, record).approvals_version() == (0, []) and record.is_file()


def test_a_store_from_before_versions_opens_and_starts_counting(tmp_path: Path, key: bytes) -> None:
    root = tmp_path / "store"
    legacy = SiteStore(root, key, "lyon")  # no record kept, as in releases before versions
    legacy.save_approval("1-u", APPROVAL)
    (root / "approvals" / APPROVALS_STATE).unlink()
    (root / "approvals" / "_lock").unlink()
    shutil.copytree(root, tmp_path / "old")
    store = open_store(root, key)
    assert store.approvals_version() == (0, ["1-u"]) and store.recorded_version() == 0
    store.remove_approval("1-u")
    restore(tmp_path / "old", root)  # the old store, without a version, once a version is recorded
    with pytest.raises(StaleStore, match=r"its approvals have no version; .* records version 1"):
        open_store(root, key)


def test_a_store_ahead_of_its_record_opens_and_the_record_catches_up(tmp_path: Path, key: bytes) -> None:
    """A crash after the store's version was written and before the record was: not a restored copy."""
    root = tmp_path / "store"
    open_store(root, key).save_approval("1-u", APPROVAL)
    SiteStore(root, key, "lyon").save_approval("2-u", APPROVAL)  # its record not written
    store = open_store(root, key)
    assert store.approvals_version() == (2, ["1-u", "2-u"]) and store.recorded_version() == 2


def test_the_record_is_written_atomically_and_authenticated(
    tmp_path: Path, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, record = tmp_path / "store", tmp_path / "store.approvals-version"
    store = open_store(root, key)
    store.save_approval("1-u", APPROVAL)
    assert record.stat().st_mode & 0o777 == 0o600 and b"version" not in record.read_bytes()
    written = record.read_bytes()
    replace = os.replace

    def crash_on_the_record(source: Path, target: Path) -> None:
        if Path(target) == record:
            raise OSError("disk full")
        replace(source, target)

    monkeypatch.setattr(store_module.os, "replace", crash_on_the_record)
    with pytest.raises(OSError, match="disk full"):
        store.save_approval("2-u", APPROVAL)
    monkeypatch.undo()
    assert record.read_bytes() == written and {p.name for p in tmp_path.iterdir()} == {record.name, "store"}
    assert open_store(root, key).recorded_version() == 2  # the store was ahead: the record caught up
    open_store(tmp_path / "other", generate_key(), tmp_path / "other.version")  # another store's record
    record.write_bytes((tmp_path / "other.version").read_bytes())
    with pytest.raises(TamperedFile, match="failed authentication"):
        open_store(root, key)


def test_approvals_changed_at_once_by_two_processes_keep_one_count(tmp_path: Path, key: bytes) -> None:
    root = tmp_path / "store"
    stores = [open_store(root, key) for _ in range(2)]  # the agent and `cardiofl site approve`, each its own lock

    def approve(store: SiteStore, prefix: str) -> None:
        for n in range(15):
            store.save_approval(f"{prefix}{n}-u", APPROVAL)

    threads = [threading.Thread(target=approve, args=(s, p)) for s, p in zip(stores, "ab", strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store = open_store(root, key)
    assert store.approvals_version() == (30, store.approved_studies()) and store.recorded_version() == 30
