"""The site's encrypted local store: private tensors phi_k, pending uploads and study approvals, AES-256-GCM at rest.

Every file is sealed to its place (site, study, round, kind) and written atomically
(site_agent/store_files.py). A key check file, written when the store is created, makes a wrong
key fail before anything is read or written; a tampered file fails its tag and is reported, never
overwritten.

Layout under the store root:

    keycheck.enc                          proves the key on every start
    studies/<id>-<uid>/local-r000003.enc  phi_k committed after round 3 was accepted (last `keep` kept)
    studies/<id>-<uid>/pending.enc        trained phi_k + the exact upload bytes, before acknowledgement
    approvals/<id>-<uid>.enc              the operator's approval of a study (deleted when revoked)
    approvals/_state.enc                  the approvals' version (one more at every approval or revocation)
                                          and the studies approved at it; approvals/_lock serialises changes
    studies/<id>-<uid>/record-decline.enc the operator's decline of a study (deleted when it is approved)
    protected-<name>.enc                  a protected record and its count (the secure-aggregation ledger)
    record-<name>.enc                     a small record (the site's signing identity, its task declines)
    downloads/<sha256>.part, .json        a global model's bytes kept while it downloads, so that a restart
                                          resumes it (site_agent/kept_partials.py): not encrypted, as
                                          theta^g is no secret of the site, and checked by its digest

The approvals and the protected records are counted in the store and in `version_file` outside it
(site_agent/store_guard.py), so an older copy of the store, restored, is refused (StaleStore).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shlex
import stat
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from shared.tensors.codec import Header, MalformedPayload, TensorDict, dump, dump_pieces, header_end, load, read_header
from site_agent.store_files import SealedFiles, StaleStore, StoreError, TamperedFile, atomic_write, safe_id
from site_agent.store_guard import APPROVALS_STATE, StoreGuard

__all__ = [
    "APPROVALS_STATE",
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

KEY_BYTES = 32
KEYCHECK_PLAINTEXT = b"cardiofl site store key check v1"


# * StoreError
#   + KeyMissing        no key in the environment or key file
#   + InsecureKeyFile   the key file is readable by group or others
#   + WrongKey          the key does not open this store
#   + TamperedFile      a file fails authentication (edited, truncated, or moved)
#   + StaleStore        an older copy of the store was restored (its approvals or ledger are behind their record)
# (StoreError, TamperedFile and StaleStore live in site_agent/store_files.py.)


class KeyMissing(StoreError):
    """No store key was configured."""


class InsecureKeyFile(StoreError):
    """The key file's permissions let other users read it."""


class WrongKey(StoreError):
    """The configured key does not open this store."""


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
        keygen = f"cardiofl site keygen --out {shlex.quote(str(key_file))}"
        raise KeyMissing(f"store key file {key_file} does not exist (create one with `{keygen}`)")
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


class SiteStore:
    """Encrypted files of one site: committed phi_k per round and at most one pending update per study."""

    def __init__(self, root: Path, key: bytes, site: str, *, keep: int = 3, version_file: Path | None = None) -> None:
        """Open (or create) the store; with `version_file`, StaleStore when it is older than the record kept there."""
        if len(key) != KEY_BYTES:
            raise StoreError(f"store key must be {KEY_BYTES} bytes")
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.root, self.site, self.keep = root, safe_id(site, "site"), keep
        self.version_file = version_file  # the counts, recorded outside the store (None: not kept)
        self._files = SealedFiles(key, self.site)
        self._guard = StoreGuard(root, self._files, version_file)
        self._open()
        if version_file is not None:
            self._guard.check()

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
        atomic_write(check, self._encrypt(KEYCHECK_PLAINTEXT, self._ad("keycheck")))

    def _ad(self, kind: str, study: str = "", round_: int = -1) -> bytes:
        return self._files.place(kind, study, round_)

    def _encrypt(self, plain: bytes, ad: bytes) -> bytes:
        return self._files.seal(plain, ad)

    def _decrypt_file(self, path: Path, ad: bytes) -> bytes:
        return self._files.open(path, ad)

    def _study_dir(self, study: str) -> Path:
        return self.root / "studies" / safe_id(study, "study")

    # -- committed phi_k ---------------------------------------------------------------------

    def save_local(self, study: str, round_: int, tensors: Mapping[str, Tensor]) -> None:
        """Commit phi_k as of `round_`; drop rounds older than the last `keep`, and any later one.

        A later round can only be left from a past that no longer holds (a coordinator restored
        from a backup): it must not count among the `keep`, nor ever be read again.
        """
        folder = self._study_dir(study)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(
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
        """Write the trained phi_k and the exact upload before sending it, sealed a chunk at a time.

        The record is the safetensors `dump` of both as byte tensors; the upload's bytes are viewed,
        not copied, so a gigabyte's upload costs the store no more than a chunk of memory.
        """
        folder = self._study_dir(study)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tensors = {"upload": _byte_tensor(pending.upload), "local": _byte_tensor(dump(pending.local))}
        meta = {"round": str(pending.round), "meta": json.dumps(pending.meta, sort_keys=True)}
        self._files.seal_to(folder / "pending.enc", dump_pieces(tensors, meta), self._ad("pending", study))

    def load_pending(self, study: str) -> PendingUpdate | None:
        """The pending update of `study`, if one was saved and not yet committed or discarded."""
        record = self._read_pending(study, ("local", "upload"))
        if record is None:
            return None
        fields, meta = record
        local, _ = load(fields["local"])
        return PendingUpdate(int(meta["round"]), fields["upload"], local, json.loads(meta["meta"]))

    def commit_pending(self, study: str) -> int:
        """The coordinator accepted the pending upload: make its phi_k the committed one (the upload is not kept)."""
        record = self._read_pending(study, ("local",))
        if record is None:
            raise StoreError(f"no pending update for study {study}")
        fields, meta = record
        round_ = int(meta["round"])
        self.save_local(study, round_, load(fields["local"])[0])
        self.discard_pending(study)
        return round_

    def _read_pending(self, study: str, wanted: tuple[str, ...]) -> tuple[dict[str, bytearray], dict[str, str]] | None:
        """The byte fields `wanted` of the pending record of `study` and its metadata; None when there is none.

        The file is opened a chunk at a time and only the fields asked for are kept: committing a
        round reads phi_k without holding the upload.
        """
        path = self._study_dir(study) / "pending.enc"
        if not path.exists():
            return None
        record = _RecordFields(wanted, self._files.plain_size(path))
        chunks = self._files.open_chunks(path, self._ad("pending", study))
        try:
            for chunk in chunks:
                record.add(chunk)
            return record.result()
        except MalformedPayload as exc:  # authenticated bytes that are no record, or a tampered file: which?
            for _ in chunks:  # the rest is read to its tag: TamperedFile when it fails
                pass
            raise StoreError(f"{path} holds no pending record: {exc}") from None

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
        atomic_write(path, self._encrypt(plain, self._ad(f"record:{name}", study)))

    def load_record(self, name: str, study: str = "") -> dict[str, Any] | None:
        """The record kept under `name`, or None; TamperedFile when it was altered or moved."""
        path = self._record_path(name, study)
        return json.loads(self._decrypt_file(path, self._ad(f"record:{name}", study))) if path.exists() else None

    def remove_record(self, name: str, study: str = "") -> bool:
        """Delete the record kept under `name`, the store's or `study`'s; True when there was one."""
        path = self._record_path(name, study)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed

    def studies_with_record(self, name: str) -> list[str]:
        """The keys of the studies that keep a record under `name`."""
        return sorted(p.parent.name for p in (self.root / "studies").glob(f"*/record-{safe_id(name, 'record')}.enc"))

    def _record_path(self, name: str, study: str) -> Path:
        folder = self._study_dir(study) if study else self.root
        return folder / f"record-{safe_id(name, 'record')}.enc"

    # -- approvals of studies by the site's operator, and protected records (site_agent/store_guard.py) ----

    def save_approval(self, study: str, record: Mapping[str, Any]) -> None:
        """Record the operator's approval of `study` (its description's digest, who, when): one version on."""
        plain = json.dumps(dict(record), sort_keys=True).encode()
        self._guard.change_approval(study, self._encrypt(plain, self._ad("approval", study)))

    def load_approval(self, study: str) -> dict[str, Any] | None:
        """The recorded approval of `study`, or None when there is none (never approved, or revoked)."""
        path = self._guard.approval_path(study)
        if not path.exists():
            return None
        record: dict[str, Any] = json.loads(self._decrypt_file(path, self._ad("approval", study)))
        return record

    def approved_studies(self) -> list[str]:
        """The keys of the studies with a recorded approval."""
        return self._guard.approved_studies()

    def remove_approval(self, study: str) -> bool:
        """Forget the approval of `study`, one version on; True when there was one."""
        existed = self._guard.approval_path(study).exists()
        self._guard.change_approval(study, None)
        return existed

    def approvals_version(self) -> tuple[int, list[str]] | None:
        """The approvals' version and the studies approved at it, as the store holds them; None: never recorded."""
        return self._guard.approvals_version()

    def recorded_version(self) -> int | None:
        """The approvals' version recorded outside the store, in `version_file`; None when there is none."""
        return self._guard.recorded_version()

    def save_protected(self, name: str, record: Mapping[str, Any]) -> None:
        """Keep `record` under `name` at its next count, in the store and outside it: an older copy is StaleStore."""
        self._guard.save_protected(name, record)

    def load_protected(self, name: str) -> dict[str, Any] | None:
        """The protected record `name`, or None when there is none."""
        return self._guard.load_protected(name)


def _byte_tensor(data: bytes | bytearray) -> Tensor:
    """`data` as a uint8 tensor viewing it, not a copy (read only: it is only ever serialised)."""
    with warnings.catch_warnings():  # PyTorch warns that a tensor over read-only bytes could be written to
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class _RecordFields:
    """Some byte tensors of a safetensors record of `size` bytes fed a chunk at a time: only theirs are held."""

    def __init__(self, wanted: tuple[str, ...], size: int) -> None:
        self.wanted, self.size = wanted, size
        self.prefix = bytearray()  # the record's bytes until its header is whole
        self.header: Header | None = None
        self.fields: dict[str, bytearray] = {}
        self.position = 0  # data-section bytes seen

    def add(self, chunk: bytes) -> None:
        """Take the record's next bytes; MalformedPayload when its header is not a record's."""
        if self.header is None:
            self.prefix += chunk
            if len(self.prefix) < 8 or len(self.prefix) < header_end(self.prefix, self.size):
                return
            self.header = read_header(self.prefix, self.size)
            missing = set(self.wanted) - self.header.offsets.keys()
            if missing:
                raise MalformedPayload(f"the record has no {', '.join(sorted(missing))}")
            self.fields = {name: bytearray(end - begin) for name, (begin, end) in self._ranges()}
            rest, self.prefix = memoryview(self.prefix)[self.header.data_start :], bytearray()
            self._copy(rest)
            return
        self._copy(memoryview(chunk))

    def result(self) -> tuple[dict[str, bytearray], dict[str, str]]:
        """The fields and the record's metadata, once every byte was taken."""
        if self.header is None:
            raise MalformedPayload("the record ends inside its header")
        return self.fields, self.header.metadata

    def _ranges(self) -> list[tuple[str, tuple[int, int]]]:
        assert self.header is not None
        return [(name, self.header.offsets[name]) for name in self.wanted]

    def _copy(self, data: memoryview) -> None:
        start, end = self.position, self.position + len(data)
        for name, (begin, stop) in self._ranges():
            low, high = max(begin, start), min(stop, end)
            if low < high:
                self.fields[name][low - begin : high - begin] = data[low - start : high - start]
        self.position = end
