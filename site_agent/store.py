"""The site's encrypted local store: private tensors phi_k, pending uploads and study approvals, AES-256-GCM at rest.

Every file is `MAGIC | nonce (12 bytes) | ciphertext+tag`; the associated data binds the site,
the study, the round and the record kind, so a file moved to another study, site or round fails
to decrypt. Files are written atomically (temp file, fsync, rename, fsync of the folder). A key
check file, written when the store is created, makes a wrong key fail before anything is read or
written; a tampered file fails its tag and is reported, never overwritten.

Layout under the store root:

    keycheck.enc                          proves the key on every start
    studies/<id>-<uid>/local-r000003.enc  phi_k committed after round 3 was accepted (last `keep` kept)
    studies/<id>-<uid>/pending.enc        trained phi_k + the exact upload bytes, before acknowledgement
    approvals/<id>-<uid>.enc              the operator's approval of a study (deleted when revoked)
    approvals/_state.enc                  the approvals' version (one more at every approval or revocation)
                                          and the studies approved at it; approvals/_lock serialises changes

Revoking an approval deletes its file, so an older copy of the store, restored, would approve again
what was revoked since. The approvals' version is therefore also recorded outside the store, in
`version_file` (the agent keeps it beside its key: site_agent.config.approvals_version_file), and
checked when the store opens: StaleStore when the store's version is older than the record, when
the record is missing while the store's version is above 0, or when an approval file is one the
store's version does not list. A store without approvals, or one from before versions were kept
(no state and no record yet), opens and starts counting.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from torch import Tensor

from shared.tensors import TensorDict, dump, load

__all__ = [
    "InsecureKeyFile",
    "KeyMissing",
    "PendingUpdate",
    "SiteStore",
    "StaleStore",
    "StoreError",
    "TamperedFile",
    "WrongKey",
    "generate_key",
    "load_key",
    "write_key_file",
]

MAGIC = b"CFLSTORE1"
NONCE_BYTES = 12
KEY_BYTES = 32
KEYCHECK_PLAINTEXT = b"cardiofl site store key check v1"
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
APPROVALS_STATE = "_state.enc"  # in approvals/; no study key starts with "_"
APPROVALS_LOCK = "_lock"


# * StoreError
#   + KeyMissing        no key in the environment or key file
#   + InsecureKeyFile   the key file is readable by group or others
#   + WrongKey          the key does not open this store
#   + TamperedFile      a file fails authentication (edited, truncated, or moved)
#   + StaleStore        an older copy of the store was restored (its approvals are behind their record)


class StoreError(RuntimeError):
    """The local store cannot be used; the agent must stop rather than overwrite anything."""


class KeyMissing(StoreError):
    """No store key was configured."""


class InsecureKeyFile(StoreError):
    """The key file's permissions let other users read it."""


class WrongKey(StoreError):
    """The configured key does not open this store."""


class TamperedFile(StoreError):
    """A store file failed authentication: edited, truncated, or copied from elsewhere."""


class StaleStore(StoreError):
    """An older copy of the store was restored: it may hold approvals revoked since."""


def generate_key() -> bytes:
    """A fresh random AES-256 key."""
    return secrets.token_bytes(KEY_BYTES)


def _decode_key(text: str, origin: str) -> bytes:
    try:
        key = base64.urlsafe_b64decode(text.strip().encode())
    except (ValueError, TypeError):
        raise StoreError(f"{origin} is not base64") from None
    if len(key) != KEY_BYTES:
        raise StoreError(f"{origin} must hold {KEY_BYTES} bytes (base64), it holds {len(key)}")
    return key


def write_key_file(path: Path, key: bytes | None = None) -> bytes:
    """Write a new key file readable by its owner only; refuse to replace an existing one."""
    key = key if key is not None else generate_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(base64.urlsafe_b64encode(key).decode() + "\n")
    return key


def load_key(*, env_value: str | None, key_file: Path | None) -> bytes:
    """The store key from an environment value (base64) or a key file with 0600-style permissions."""
    if env_value:
        return _decode_key(env_value, "the store key from the environment")
    if key_file is None:
        raise KeyMissing("no store key: set CARDIOFL_SITE_STORE_KEY or CARDIOFL_SITE_STORE_KEY_FILE")
    if not key_file.is_file():
        raise KeyMissing(f"store key file {key_file} does not exist (create one with `cardiofl site keygen`)")
    mode = key_file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InsecureKeyFile(f"store key file {key_file} is accessible by other users; run chmod 600 {key_file}")
    return _decode_key(key_file.read_text(), f"store key file {key_file}")


@dataclass(frozen=True)
class PendingUpdate:
    """A trained round waiting for the coordinator's acknowledgement."""

    round: int
    upload: bytes | bytearray  # the exact safetensors bytes sent (re-sent unchanged after a restart)
    local: TensorDict  # phi_k after training, committed only once the upload is accepted
    meta: dict[str, object]  # n_k, metrics and anything else sent with the upload


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
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


class SiteStore:
    """Encrypted files of one site: committed phi_k per round and at most one pending update per study."""

    def __init__(self, root: Path, key: bytes, site: str, *, keep: int = 3, version_file: Path | None = None) -> None:
        """Open (or create) the store; with `version_file`, StaleStore when it is older than the record kept there."""
        if len(key) != KEY_BYTES:
            raise StoreError(f"store key must be {KEY_BYTES} bytes")
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.root, self.site, self.keep = root, _safe_id(site, "site"), keep
        self.version_file = version_file  # the approvals' version, recorded outside the store (None: not kept)
        self._aead = AESGCM(key)
        self._open()
        if version_file is not None:
            self._check_approvals_version()

    # -- files ------------------------------------------------------------------------------

    def _open(self) -> None:
        """Create the store, or prove the key on an existing one, before touching anything else."""
        check = self.root / "keycheck.enc"
        if check.exists():
            try:
                plain = self._decrypt_file(check, self._ad("keycheck"))
            except TamperedFile:
                raise WrongKey(f"the configured key does not open the store at {self.root}") from None
            if plain != KEYCHECK_PLAINTEXT:
                raise WrongKey(f"the configured key does not open the store at {self.root}")
            return
        if self.root.exists() and any(self.root.iterdir()):
            raise StoreError(f"{self.root} holds files but no keycheck.enc: not a cardiofl store; refusing to use it")
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        _atomic_write(check, self._encrypt(KEYCHECK_PLAINTEXT, self._ad("keycheck")))

    def _ad(self, kind: str, study: str = "", round_: int = -1) -> bytes:
        return f"cardiofl-store/v1|site={self.site}|study={study}|round={round_}|kind={kind}".encode()

    def _encrypt(self, plain: bytes, ad: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, plain, ad)

    def _decrypt_file(self, path: Path, ad: bytes) -> bytes:
        blob = path.read_bytes()
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + NONCE_BYTES + 16:
            raise TamperedFile(f"{path} is not a cardiofl store file (bad header or truncated)")
        nonce = blob[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, blob[len(MAGIC) + NONCE_BYTES :], ad)
        except InvalidTag:
            raise TamperedFile(f"{path} failed authentication: it was modified, truncated or moved") from None

    def _study_dir(self, study: str) -> Path:
        return self.root / "studies" / _safe_id(study, "study")

    # -- committed phi_k ---------------------------------------------------------------------

    def save_local(self, study: str, round_: int, tensors: Mapping[str, Tensor]) -> None:
        """Commit phi_k as of `round_`; drop rounds older than the last `keep`, and any later one.

        A later round can only be left from a past that no longer holds (a coordinator restored
        from a backup): it must not count among the `keep`, nor ever be read again.
        """
        folder = self._study_dir(study)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        _atomic_write(
            folder / f"local-r{round_:06d}.enc", self._encrypt(dump(tensors), self._ad("local", study, round_))
        )
        rounds = self.local_rounds(study)
        kept = [r for r in rounds if r <= round_][-self.keep :]
        for old in set(rounds) - set(kept):
            (folder / f"local-r{old:06d}.enc").unlink(missing_ok=True)

    def local_rounds(self, study: str) -> list[int]:
        """Rounds with a committed phi_k, oldest first."""
        folder = self._study_dir(study)
        if not folder.is_dir():
            return []
        return sorted(int(p.stem[len("local-r") :]) for p in folder.glob("local-r*.enc"))

    def load_local(self, study: str, round_: int | None = None) -> tuple[int, TensorDict] | None:
        """The phi_k committed at `round_` (default: the latest), or None when there is none."""
        rounds = self.local_rounds(study)
        if not rounds:
            return None
        chosen = rounds[-1] if round_ is None else round_
        if chosen not in rounds:
            return None
        path = self._study_dir(study) / f"local-r{chosen:06d}.enc"
        tensors, _ = load(self._decrypt_file(path, self._ad("local", study, chosen)))
        return chosen, tensors

    def load_local_before(self, study: str, round_: int) -> tuple[int, TensorDict] | None:
        """The latest phi_k committed in a round before `round_` (a retried round never sees its own)."""
        earlier = [r for r in self.local_rounds(study) if r < round_]
        return self.load_local(study, earlier[-1]) if earlier else None

    # -- pending update ----------------------------------------------------------------------

    def save_pending(self, study: str, pending: PendingUpdate) -> None:
        """Write the trained phi_k and the exact upload before sending it."""
        folder = self._study_dir(study)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        record = dump(
            {
                "upload": torch.frombuffer(bytearray(pending.upload), dtype=torch.uint8),
                "local": torch.frombuffer(bytearray(dump(pending.local)), dtype=torch.uint8),
            },
            {"round": str(pending.round), "meta": json.dumps(pending.meta, sort_keys=True)},
        )
        _atomic_write(folder / "pending.enc", self._encrypt(record, self._ad("pending", study)))

    def load_pending(self, study: str) -> PendingUpdate | None:
        """The pending update of `study`, if one was saved and not yet committed or discarded."""
        path = self._study_dir(study) / "pending.enc"
        if not path.exists():
            return None
        tensors, meta = load(self._decrypt_file(path, self._ad("pending", study)))
        local, _ = load(tensors["local"].numpy().tobytes())
        return PendingUpdate(int(meta["round"]), tensors["upload"].numpy().tobytes(), local, json.loads(meta["meta"]))

    def commit_pending(self, study: str) -> int:
        """The coordinator accepted the pending upload: make its phi_k the committed one."""
        pending = self.load_pending(study)
        if pending is None:
            raise StoreError(f"no pending update for study {study}")
        self.save_local(study, pending.round, pending.local)
        self.discard_pending(study)
        return pending.round

    def pending_studies(self) -> list[str]:
        """Studies that have a pending upload, e.g. after a crash between training and acknowledgement."""
        return sorted(p.parent.name for p in (self.root / "studies").glob("*/pending.enc"))

    def discard_pending(self, study: str) -> None:
        """Forget the pending update (the coordinator refused it or the round is gone)."""
        (self._study_dir(study) / "pending.enc").unlink(missing_ok=True)

    # -- small records: the site's signing identity, what it revealed (site_agent/identity.py) ---

    def save_record(self, name: str, record: Mapping[str, Any], study: str = "") -> None:
        """Keep `record` (JSON) encrypted under `name`, the store's or `study`'s; written atomically."""
        path = self._record_path(name, study)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        plain = json.dumps(dict(record), sort_keys=True).encode()
        _atomic_write(path, self._encrypt(plain, self._ad(f"record:{name}", study)))

    def load_record(self, name: str, study: str = "") -> dict[str, Any] | None:
        """The record kept under `name`, or None; TamperedFile when it was altered or moved."""
        path = self._record_path(name, study)
        return json.loads(self._decrypt_file(path, self._ad(f"record:{name}", study))) if path.exists() else None

    def _record_path(self, name: str, study: str) -> Path:
        folder = self._study_dir(study) if study else self.root
        return folder / f"record-{_safe_id(name, 'record')}.enc"

    # -- approvals of studies by the site's operator ------------------------------------------

    def _approval_path(self, study: str) -> Path:
        """The file of the operator's approval of `study`."""
        return self.root / "approvals" / f"{_safe_id(study, 'study')}.enc"

    def save_approval(self, study: str, record: Mapping[str, Any]) -> None:
        """Record the operator's approval of `study` (its description's digest, who, when): one version on."""
        plain = json.dumps(dict(record), sort_keys=True).encode()
        self._change_approval(study, self._encrypt(plain, self._ad("approval", study)))

    def load_approval(self, study: str) -> dict[str, Any] | None:
        """The recorded approval of `study`, or None when there is none (never approved, or revoked)."""
        path = self._approval_path(study)
        if not path.exists():
            return None
        return json.loads(self._decrypt_file(path, self._ad("approval", study)))

    def approved_studies(self) -> list[str]:
        """The keys of the studies with a recorded approval."""
        return sorted(p.stem for p in (self.root / "approvals").glob("*.enc") if SAFE_ID.match(p.stem))

    def remove_approval(self, study: str) -> bool:
        """Forget the approval of `study`, one version on; True when there was one."""
        existed = self._approval_path(study).exists()
        self._change_approval(study, None)
        return existed

    # -- the approvals' version, in the store and outside it ---------------------------------------

    def approvals_version(self) -> tuple[int, list[str]] | None:
        """The approvals' version and the studies approved at it, as the store holds them; None: never recorded."""
        path = self.root / "approvals" / APPROVALS_STATE
        if not path.exists():
            return None
        state = json.loads(self._decrypt_file(path, self._ad("approvals-state")))
        return int(state["version"]), list(state["studies"])

    def recorded_version(self) -> int | None:
        """The approvals' version recorded outside the store, in `version_file`; None when there is none."""
        if self.version_file is None or not self.version_file.exists():
            return None
        return int(json.loads(self._decrypt_file(self.version_file, self._ad("approvals-version")))["version"])

    @contextmanager
    def _approvals_locked(self) -> Iterator[None]:
        """The approvals change one at a time, whichever process changes them (the agent, `cardiofl site approve`)."""
        folder = self.root / "approvals"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(folder / APPROVALS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and with it the lock

    def _write_version(self, version: int, studies: Iterable[str]) -> None:
        """The approvals' version and the studies approved at it, in the store."""
        plain = json.dumps({"version": version, "studies": sorted(studies)}).encode()
        _atomic_write(self.root / "approvals" / APPROVALS_STATE, self._encrypt(plain, self._ad("approvals-state")))

    def _write_record(self, version: int) -> None:
        """The approvals' version, outside the store (written atomically, like every store file)."""
        if self.version_file is not None:
            plain = json.dumps({"version": version}).encode()
            _atomic_write(self.version_file, self._encrypt(plain, self._ad("approvals-version")))

    def _change_approval(self, study: str, approval: bytes | None) -> None:
        """Write (or, None, delete) a study's approval file at the next version, recorded in the store, then outside.

        The store's list of approved studies never misses a file (a study is listed before its file is
        written, and unlisted after it is deleted), and the store's version is never behind the record,
        so a crash between the steps cannot look like a restored copy.
        """
        path = self._approval_path(study)
        with self._approvals_locked():
            version, studies = self.approvals_version() or (0, self.approved_studies())
            if approval is None:
                path.unlink(missing_ok=True)
                self._write_version(version + 1, set(studies) - {study})
            else:
                self._write_version(version + 1, {*studies, study})
                _atomic_write(path, approval)
            self._write_record(version + 1)

    def _check_approvals_version(self) -> None:
        """StaleStore when the store's approvals are behind the record outside it; else bring the record up to date."""
        with self._approvals_locked():
            held, recorded, files = self.approvals_version(), self.recorded_version(), self.approved_studies()
            if held is None:
                if files and recorded is not None:
                    raise self._stale(f"its approvals have no version; {self.version_file} records version {recorded}")
                held = (recorded or 0, files)  # a new store, one without approvals, or one from before versions
                self._write_version(*held)
            version, listed = held
            if recorded is None and version > 0:
                raise self._stale(f"its approvals are at version {version}; {self.version_file} is missing")
            if recorded is not None and version < recorded:
                raise self._stale(f"its approvals are at version {version}; {self.version_file} records {recorded}")
            unlisted = sorted(set(files) - set(listed))
            if unlisted:
                raise self._stale(f"approvals of {', '.join(unlisted)} are not in its version {version}")
            if recorded is None or version > recorded:  # the first start with a record, or a crash before it
                self._write_record(version)

    def _stale(self, finding: str) -> StaleStore:
        """The error of an older copy of the store: what was found, and what the operator may do."""
        return StaleStore(
            f"an older copy of the store at {self.root} was restored ({finding}): it may approve studies whose "
            f"approval was revoked since. Restore the newest copy of the store, or remove {self.root / 'approvals'} "
            "and approve the studies again (`cardiofl site studies`, `cardiofl site approve`)"
        )


def _safe_id(value: str, what: str) -> str:
    if not SAFE_ID.match(value):
        raise ValueError(f"{what} id {value!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    return value
