"""Train/test assignment per record (a seeded hash of the id, a split file, or FedCVD's), and validation carves."""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from site_agent.data.sources import FEDCVD_SPLIT_FILES, strip_wfdb_suffix

__all__ = ["FedcvdRow", "FedcvdSplit", "SplitFile", "is_test_record", "validation_rows"]

_SPLITS = {"train": False, "test": True}


def is_test_record(record_id: str, *, seed: int, test_fraction: float) -> bool:
    """Seeded, per record: adding or removing other records never moves this one between splits.

    About `test_fraction` of the records land in the test split (80/20 by default, as FedCVD).
    """
    digest = hashlib.sha256(f"{seed}\x00{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < test_fraction * 2**64


def _validation_rank(seed: int, record_id: str) -> bytes:
    return hashlib.sha256(f"validation\x00{seed}\x00{record_id}".encode()).digest()


def validation_rows(record_ids: Sequence[str], *, seed: int, fraction: float) -> np.ndarray:
    """Ascending indices of round(fraction * n) of the n records (at least one, never all), chosen by `seed`."""
    # Each record is ranked by a seeded hash of its id: the choice depends on the seed and the ids
    # only, not on the order the records were read in.
    if not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    n = len(record_ids)
    if n < 2:
        raise ValueError(f"carving a validation split needs at least 2 training records, the site has {n}")
    count = min(max(round(fraction * n), 1), n - 1)
    ranked = sorted(range(n), key=lambda row: _validation_rank(seed, record_ids[row]))
    return np.sort(np.asarray(ranked[:count], dtype=np.int64))


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
        for key in _keys(record_id):
            if key in self._is_test:
                return self._is_test[key]
        return None

    def unknown(self, record_ids: Iterable[str]) -> list[str]:
        """The listed records that none of `record_ids` (a source's records) matches, in file order."""
        matched = {key for record_id in record_ids for key in _keys(record_id)}
        return [key for key in self._is_test if key not in matched]


def _key(record: str) -> str:
    return strip_wfdb_suffix((record or "").strip().replace("\\", "/"))


def _keys(record_id: str) -> tuple[str, str]:
    return _key(record_id), _key(Path(record_id).name)


@dataclass(frozen=True)
class FedcvdRow:
    """One row of FedCVD's split: which side, and what FedCVD recorded of the record."""

    is_test: bool
    classes: tuple[int, ...]  # Code_Label
    age: float | None
    sex: str  # 'm', 'f' or '' when the file has no Sex column


class FedcvdSplit:
    """FedCVD's split of one client: `train.csv` and `test.csv` in its `appendix/ECG/clientK` folder.

    Rows are keyed by ECG_ID, FedCVD's numbering (000000, 000001 ...) of the records it kept, in its
    reading order: labels known, 0 < age < 120 (and a known sex for SXPH/G12EC), signal neither NaN nor
    all zero. Code_Label (class indices joined by ';'), Age and Sex let each numbered record be checked.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.rows: dict[int, FedcvdRow] = {}
        for name in FEDCVD_SPLIT_FILES:
            self._read(folder / name, is_test=name.startswith("test"))

    def _read(self, path: Path, *, is_test: bool) -> None:
        try:
            handle = path.open(newline="", encoding="utf-8-sig")
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror or type(exc).__name__}") from None
        with handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or not {"ECG_ID", "Code_Label"} <= set(reader.fieldnames):
                raise ValueError(f"{path}: FedCVD's split files need the columns ECG_ID and Code_Label")
            for line, row in enumerate(reader, start=2):
                try:
                    ecg_id = int(row["ECG_ID"])
                    classes = tuple(sorted({int(c) for c in (row["Code_Label"] or "").split(";") if c.strip()}))
                    age = float(row["Age"]) if (row.get("Age") or "").strip() else None
                except ValueError as exc:
                    raise ValueError(f"{path}:{line}: {exc}") from None
                if ecg_id in self.rows:
                    raise ValueError(f"{path}:{line}: ECG_ID {row['ECG_ID']} is listed twice")
                sex = (row.get("Sex") or "").strip().lower()[:1]
                self.rows[ecg_id] = FedcvdRow(is_test, classes, age, sex)

    def mismatch(self, ecg_id: int, classes: tuple[int, ...], age: str | None, sex: str | None) -> str | None:
        """Why row `ecg_id` does not describe a record with these classes, age and sex; None when it does."""
        row = self.rows[ecg_id]
        if row.classes != classes:
            return f"ECG_ID {ecg_id:06d}: FedCVD has classes {row.classes}, the record {classes}"
        try:
            years = float(age or "nan")
        except ValueError:
            years = float("nan")
        if row.age is not None and row.age != years:
            return f"ECG_ID {ecg_id:06d}: FedCVD has age {row.age:g}, the record {age}"
        if row.sex and row.sex != (sex or "").strip().lower()[:1]:
            return f"ECG_ID {ecg_id:06d}: FedCVD has sex {row.sex}, the record {sex}"
        return None
