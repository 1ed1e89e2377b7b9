"""What an older copy of the store, restored, must not undo: the operator's approvals and the protected records.

Revoking an approval deletes its file, so an older copy of the store, restored, would approve again
what was revoked since; a secure-aggregation ledger that went back (site_agent/ledger.py) would let
the site take part again in a round that a coordinator could difference with an earlier one. Each is
kept in the store with a count that moves on at every change (the approvals' version with the
studies approved at it, in approvals/_state.enc; a protected record's own count, in its file), and
the counts are recorded outside the store too, in `version_file` (the agent keeps it beside its
key: site_agent.config.approvals_version_file). When the store opens, `check` raises StaleStore when
a count in the store is behind the record, when the record is missing while the store moved on, or
when an approval file is one the store's version does not list. A store ahead of the record (a
crash between the two writes) brings the record up to date; a store from before counts were kept
opens and starts counting. Changes are serialised across processes (the agent, `cardiofl site
approve`) by a lock file, approvals/_lock.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from site_agent.store_files import SAFE_ID, SealedFiles, StaleStore, atomic_write, safe_id

__all__ = ["APPROVALS_LOCK", "APPROVALS_STATE", "StoreGuard"]

APPROVALS_STATE = "_state.enc"  # in approvals/; no study key starts with "_"
APPROVALS_LOCK = "_lock"
_PROTECTED = "protected-"  # protected-<name>.enc at the store's root


class StoreGuard:
    """The approvals and the protected records of one store, counted in it and in `version_file` outside it."""

    def __init__(self, root: Path, files: SealedFiles, version_file: Path | None) -> None:
        self.root, self.files, self.version_file = root, files, version_file

    # -- approvals -------------------------------------------------------------------------------

    def approval_path(self, study: str) -> Path:
        """The file of the operator's approval of `study`."""
        return self.root / "approvals" / f"{safe_id(study, 'study')}.enc"

    def approved_studies(self) -> list[str]:
        """The keys of the studies with an approval file."""
        return sorted(p.stem for p in (self.root / "approvals").glob("*.enc") if SAFE_ID.match(p.stem))

    def approvals_version(self) -> tuple[int, list[str]] | None:
        """The approvals' version and the studies approved at it, as the store holds them; None: never recorded."""
        path = self.root / "approvals" / APPROVALS_STATE
        if not path.exists():
            return None
        state = json.loads(self.files.open(path, self.files.place("approvals-state")))
        return int(state["version"]), list(state["studies"])

    def change_approval(self, study: str, approval: bytes | None) -> None:
        """Write (or, None, delete) a study's approval file at the next version, recorded in the store, then outside.

        The store's list of approved studies never misses a file (a study is listed before its file is
        written, and unlisted after it is deleted), and the store's version is never behind the record,
        so a crash between the steps cannot look like a restored copy.
        """
        path = self.approval_path(study)
        with self.locked():
            version, studies = self.approvals_version() or (0, self.approved_studies())
            if approval is None:
                path.unlink(missing_ok=True)
                self._write_version(version + 1, set(studies) - {study})
            else:
                self._write_version(version + 1, {*studies, study})
                atomic_write(path, approval)
            self._record(version=version + 1)

    def _write_version(self, version: int, studies: Iterable[str]) -> None:
        plain = json.dumps({"version": version, "studies": sorted(studies)}).encode()
        state = self.root / "approvals" / APPROVALS_STATE
        atomic_write(state, self.files.seal(plain, self.files.place("approvals-state")))

    # -- protected records -----------------------------------------------------------------------

    def _protected_path(self, name: str) -> Path:
        return self.root / f"{_PROTECTED}{safe_id(name, 'record')}.enc"

    def _load_counted(self, name: str) -> tuple[int, dict[str, Any]] | None:
        path = self._protected_path(name)
        if not path.exists():
            return None
        held = json.loads(self.files.open(path, self.files.place(f"protected:{name}")))
        return int(held["count"]), dict(held["record"])

    def load_protected(self, name: str) -> dict[str, Any] | None:
        """The protected record `name`, or None when there is none."""
        held = self._load_counted(name)
        return held[1] if held is not None else None

    def save_protected(self, name: str, record: Mapping[str, Any]) -> None:
        """Keep `record` under `name` at its next count, in the store, then outside it."""
        with self.locked():
            count = (self._load_counted(name) or (0, {}))[0]
            if name not in self._recorded_counts():  # a baseline first: a crash below then reads as the store ahead
                self._record(protected={name: count})
            plain = json.dumps({"count": count + 1, "record": dict(record)}, sort_keys=True).encode()
            path = self._protected_path(name)
            atomic_write(path, self.files.seal(plain, self.files.place(f"protected:{name}")))
            self._record(protected={name: count + 1})

    # -- the record outside the store ------------------------------------------------------------

    def _outside(self) -> dict[str, Any] | None:
        """The counts recorded in `version_file`; None when there is none (or none is kept)."""
        if self.version_file is None or not self.version_file.exists():
            return None
        return dict(json.loads(self.files.open(self.version_file, self.files.place("approvals-version"))))

    def recorded_version(self) -> int | None:
        """The approvals' version recorded outside the store; None when there is none."""
        outside = self._outside()
        return int(outside["version"]) if outside is not None else None

    def _recorded_counts(self) -> dict[str, int]:
        return {name: int(count) for name, count in ((self._outside() or {}).get("protected") or {}).items()}

    def _record(self, *, version: int | None = None, protected: Mapping[str, int] | None = None) -> None:
        """Move the record outside the store on (written atomically, like every store file); nothing without one."""
        if self.version_file is None:
            return
        outside = self._outside() or {}
        if version is not None or "version" not in outside:
            outside["version"] = version if version is not None else (self.approvals_version() or (0, []))[0]
        outside["protected"] = {**(outside.get("protected") or {}), **(protected or {})}
        atomic_write(
            self.version_file, self.files.seal(json.dumps(outside).encode(), self.files.place("approvals-version"))
        )

    @contextmanager
    def locked(self) -> Iterator[None]:
        """One change at a time, whichever process makes it (the agent, `cardiofl site approve`)."""
        folder = self.root / "approvals"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(folder / APPROVALS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and with it the lock

    # -- the check when the store opens ----------------------------------------------------------

    def check(self) -> None:
        """StaleStore when the store is behind the record outside it; else bring the record up to date."""
        with self.locked():
            self._check_approvals()
            self._check_protected()

    def _check_approvals(self) -> None:
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
            self._record(version=version)

    def _check_protected(self) -> None:
        recorded = self._recorded_counts()
        names = {p.name[len(_PROTECTED) : -len(".enc")] for p in self.root.glob(f"{_PROTECTED}*.enc")}
        for name in sorted(names | set(recorded)):
            held = self._load_counted(name)
            count, want = (held[0] if held is not None else 0), recorded.get(name)
            if want is None and count > 0:
                raise self._stale(f"its {name} is at count {count}; {self.version_file} records none")
            if want is not None and count < want:
                raise self._stale(f"its {name} is at count {count}; {self.version_file} records {want}")
            if want is None or count > want:  # the first start with a record, or a crash before it
                self._record(protected={name: count})

    def _stale(self, finding: str) -> StaleStore:
        """The error of an older copy of the store: what was found, and what the operator may do."""
        return StaleStore(
            f"an older copy of the store at {self.root} was restored ({finding}): it may approve studies whose "
            "approval was revoked since, or have forgotten what its secure rounds used (a coordinator could then "
            "difference two of them). Restore the newest copy of the store; if only the approvals are behind, "
            f"remove {self.root / 'approvals'} and approve the studies again"
        )
