"""A data source plug-in: a folder of CSV exports, one file per ECG, as many hospital ECG systems write them.

Layout: `index.csv` lists the records, with the columns `record` (a file name without `.csv`) and
`codes` (SNOMED-CT codes separated by ';'), and optionally `age`, `sex` and `split` (train|test);
each `<record>.csv` has a header row of lead names (the 12 standard leads, any order, other columns
ignored) and one row per sample, in `units` at `fs` Hz. Cardiofl's pipeline does the rest: labels,
split, FedCVD preprocessing, skips counted by reason, the cache.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from site_agent.data.config import RecordSource
from site_agent.data.record_ref import RecordRef
from site_agent.data.records import STANDARD_LEADS

__all__ = ["INDEX", "CsvFolderSource"]

INDEX = "index.csv"
_MILLIVOLTS = {"mV": 1.0, "uV": 1e-3}


class CsvFolderSource(RecordSource):
    """A folder of per-ECG CSV files listed by `index.csv` (see the module)."""

    kind: Literal["csv_folder"] = "csv_folder"
    fs: float = Field(500.0, gt=0, le=100_000)  # the files' sampling rate, Hz
    units: Literal["mV", "uV"] = "uV"  # the files' units
    label_scheme: ClassVar[str] = "snomed"

    def records(self) -> Iterator[RecordRef]:
        """Every row of index.csv; a row naming no plain file name is listed as an error (skipped, counted)."""
        index = self.path / INDEX
        with index.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or not {"record", "codes"} <= set(reader.fieldnames):
                raise ValueError(f"{index}: needs the columns record and codes")
            for line, row in enumerate(reader, start=2):
                name = (row["record"] or "").strip()
                error = None
                if not name or "/" in name or "\\" in name or name.startswith("."):
                    error = f"record {name!r} is not a file name"
                split = (row.get("split") or "").strip() or None
                yield RecordRef(
                    record_id=name if error is None else f"line-{line}",
                    path=self.path / f"{name}.csv",
                    codes=tuple(code.strip() for code in (row["codes"] or "").split(";") if code.strip()),
                    split=split if split in ("train", "test") else None,
                    age=row.get("age"),
                    sex=row.get("sex"),
                    error=error,
                )

    def read_signal(self, ref: RecordRef) -> tuple[np.ndarray, float]:
        """The 12 standard leads of one file, in mV; a missing lead or a non-number raises ValueError."""
        with ref.path.open(newline="", encoding="utf-8") as handle:
            header = [name.strip() for name in next(csv.reader([handle.readline()]))]
            missing = [lead for lead in STANDARD_LEADS if lead not in header]
            if missing:
                raise ValueError(f"no column for lead(s) {', '.join(missing)}")
            samples = np.loadtxt(handle, delimiter=",", ndmin=2, dtype=np.float64)  # (samples, columns)
        if samples.shape[1] != len(header):
            raise ValueError(f"{samples.shape[1]} values a row, {len(header)} columns named")
        order = [header.index(lead) for lead in STANDARD_LEADS]
        return samples[:, order].T * _MILLIVOLTS[self.units], self.fs
