import base64
import hashlib
import os
from pathlib import Path

import pytest
import torch

from site_agent.store import (
    InsecureKeyFile,
    KeyMissing,
    PendingUpdate,
    SiteStore,
    StoreError,
    TamperedFile,
    WrongKey,
    generate_key,
    load_key,
    write_key_file,
)


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def phi(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"blocks.0.local_branch.in_proj.weight": torch.randn(6, 4, generator=g), "c": torch.arange(3)}


def test_local_tensors_round_trip_and_are_encrypted_at_rest(tmp_path: Path) -> None:
    store = SiteStore(tmp_path, generate_key(), "site-a")
    tensors = phi(1)
    store.save_local("study1", 1, tensors)
    round_, loaded = store.load_local("study1")
    assert round_ == 1 and loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    raw = (tmp_path / "studies" / "study1" / "local-r000001.enc").read_bytes()
    assert b"local_branch" not in raw  # names are not visible
    assert tensors["blocks.0.local_branch.in_proj.weight"].numpy().tobytes()[:16] not in raw


def test_keeps_only_the_last_rounds(tmp_path: Path) -> None:
    store = SiteStore(tmp_path, generate_key(), "site-a", keep=2)
    for r in range(1, 6):
        store.save_local("s", r, phi(r))
    assert store.local_rounds("s") == [4, 5]
    assert store.load_local("s", 3) is None
    assert torch.equal(store.load_local("s")[1]["c"], torch.arange(3))


def test_committing_a_round_drops_later_ones_left_from_another_past(tmp_path: Path) -> None:
    store = SiteStore(tmp_path, generate_key(), "site-a", keep=3)
    for r in (2, 3, 4, 5):  # left from before a restore, or another database's study of the same id
        store.save_local("s", r, phi(r))
    store.save_local("s", 1, phi(1))
    assert store.local_rounds("s") == [1]  # the round just committed is never the one dropped
    assert store.load_local_before("s", 2)[0] == 1
    for r in (2, 3, 4):
        store.save_local("s", r, phi(r))
    assert store.local_rounds("s") == [2, 3, 4]


def test_pending_update_survives_reopen_and_commits(tmp_path: Path) -> None:
    key = generate_key()
    store = SiteStore(tmp_path, key, "site-a")
    store.save_local("s", 0, phi(0))
    upload = b"exact upload bytes \x00\x01"
    store.save_pending("s", PendingUpdate(3, upload, phi(3), {"num_examples": 12, "metrics": {"loss": 0.5}}))
    reopened = SiteStore(tmp_path, key, "site-a")
    pending = reopened.load_pending("s")
    assert pending is not None and pending.round == 3 and pending.upload == upload
    assert pending.meta == {"num_examples": 12, "metrics": {"loss": 0.5}}
    assert reopened.load_local("s")[0] == 0  # not applied before acknowledgement
    assert reopened.commit_pending("s") == 3
    assert reopened.load_pending("s") is None
    round_, local = reopened.load_local("s")
    assert round_ == 3 and torch.equal(
        local["blocks.0.local_branch.in_proj.weight"], phi(3)["blocks.0.local_branch.in_proj.weight"]
    )


def test_discard_pending_keeps_committed_state(tmp_path: Path) -> None:
    store = SiteStore(tmp_path, generate_key(), "site-a")
    store.save_local("s", 1, phi(1))
    store.save_pending("s", PendingUpdate(2, b"x", phi(2), {}))
    store.discard_pending("s")
    assert store.load_pending("s") is None and store.load_local("s")[0] == 1
    with pytest.raises(StoreError):
        store.commit_pending("s")


def test_wrong_key_refuses_and_leaves_files_untouched(tmp_path: Path) -> None:
    store = SiteStore(tmp_path, generate_key(), "site-a")
    store.save_local("s", 1, phi(1))
    store.save_pending("s", PendingUpdate(2, b"x", phi(2), {}))
    before = snapshot(tmp_path)
    with pytest.raises(WrongKey, match="does not open"):
        SiteStore(tmp_path, generate_key(), "site-a")
    assert snapshot(tmp_path) == before


def test_tampered_file_is_refused_and_not_overwritten(tmp_path: Path) -> None:
    key = generate_key()
    store = SiteStore(tmp_path, key, "site-a")
    store.save_local("s", 1, phi(1))
    path = tmp_path / "studies" / "s" / "local-r000001.enc"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    with pytest.raises(TamperedFile, match="failed authentication"):
        SiteStore(tmp_path, key, "site-a").load_local("s")
    assert snapshot(tmp_path) == before


def test_file_moved_to_another_round_or_site_fails(tmp_path: Path) -> None:
    key = generate_key()
    store = SiteStore(tmp_path, key, "site-a")
    store.save_local("s", 1, phi(1))
    folder = tmp_path / "studies" / "s"
    (folder / "local-r000001.enc").rename(folder / "local-r000009.enc")
    with pytest.raises(TamperedFile):
        store.load_local("s")
    with pytest.raises(WrongKey):  # the same key under another site id: associated data differs
        SiteStore(tmp_path, key, "site-b")


def test_refuses_a_folder_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(StoreError, match="not a cardiofl store"):
        SiteStore(tmp_path, generate_key(), "site-a")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_key_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "site.key"
    key = write_key_file(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert load_key(env_value=None, key_file=path) == key
    with pytest.raises(FileExistsError):
        write_key_file(path)
    env = base64.urlsafe_b64encode(key).decode()
    assert load_key(env_value=env, key_file=None) == key
    os.chmod(path, 0o644)
    with pytest.raises(InsecureKeyFile, match="chmod 600"):
        load_key(env_value=None, key_file=path)
    with pytest.raises(KeyMissing):
        load_key(env_value=None, key_file=None)
    with pytest.raises(KeyMissing, match="keygen"):
        load_key(env_value=None, key_file=tmp_path / "none.key")
    with pytest.raises(StoreError, match="32 bytes"):
        load_key(env_value=base64.urlsafe_b64encode(b"short").decode(), key_file=None)


def test_ids_are_checked(tmp_path: Path) -> None:
    store = SiteStore(tmp_path, generate_key(), "site-a")
    with pytest.raises(ValueError):
        store.save_local("../escape", 1, phi(1))


def test_load_local_before_skips_the_round_itself(tmp_path: Path) -> None:
    store = SiteStore(tmp_path, generate_key(), "site-a")
    assert store.load_local_before("s", 5) is None
    store.save_local("s", 2, phi(2))
    store.save_local("s", 4, phi(4))
    assert store.load_local_before("s", 4)[0] == 2
    assert store.load_local_before("s", 5)[0] == 4
    assert store.load_local_before("s", 2) is None
