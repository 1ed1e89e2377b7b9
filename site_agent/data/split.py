"""Train/test assignment per record: a seeded hash of the record id, or a provided split file."""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

from site_agent.data.sources import strip_wfdb_suffix

__all__ = ["SplitFile", "is_test_record"]

_SPLITS = {"train": False, "test": True}


def is_test_record(record_id: str, *, seed: int, test_fraction: float) -> bool:
    """Seeded, per record: adding or removing other records never moves this one between splits.

    About `test_fraction` of the records land in the test split (80/20 by default, as FedCVD).
    """
    digest = hashlib.sha256(f"{seed}\x00{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < test_fraction * 2**64


class SplitFile:
    """A CSV with columns `record,split` (split is train or test); records match by id or file stem."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        if not rows or not {"record", "split"} <= set(rows[0]):
            raise ValueError(f"{path}: a split file needs the columns 'record' and 'split'")
        self._is_test: dict[str, bool] = {}
        for line, row in enumerate(rows, start=2):
            split = (row["split"] or "").strip().lower()
            if split not in _SPLITS:
                raise ValueError(f"{path}:{line}: split must be 'train' or 'test', got {row['split']!r}")
            self._is_test[_key(row["record"])] = _SPLITS[split]

    def is_test(self, record_id: str) -> bool | None:
        """True/False for a listed record, None when the file does not list it."""
        for key in (_key(record_id), _key(Path(record_id).name)):
            if key in self._is_test:
                return self._is_test[key]
        return None


def _key(record: str) -> str:
    return strip_wfdb_suffix((record or "").strip().replace("\\", "/"))
