"""What loading a site's sources did: records kept, skipped by reason, labels per class, per source."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from shared.labels import CLASS_NAMES, N_CLASSES

__all__ = ["LoadReport", "SkipReason", "SourceReport"]

MAX_EXAMPLES = 5  # record ids kept per skip reason, to find the files
MAX_UNMAPPED = 20  # most frequent unmapped codes kept per source


class SkipReason(StrEnum):
    """Why a record was not loaded."""

    UNREADABLE = "unreadable"  # header or signal file missing, truncated or malformed
    MISSING_LEAD = "missing_lead"  # one of the 12 standard leads is absent
    DUPLICATE_LEAD = "duplicate_lead"  # a standard lead appears twice
    UNKNOWN_UNITS = "unknown_units"  # signal units other than V/mV/uV
    BAD_SAMPLING_RATE = "bad_sampling_rate"  # missing or non-positive rate
    EMPTY = "empty"  # no samples
    NON_FINITE = "non_finite"  # NaN or infinite samples (FedCVD: NaN)
    ALL_ZERO = "all_zero"  # every sample is zero
    NO_LABEL = "no_label"  # none of the 20 classes
    BAD_DEMOGRAPHICS = "bad_demographics"  # age outside (0, 120) or sex unknown, when required
    NOT_IN_SPLIT_FILE = "not_in_split_file"  # a split file was given and does not list the record
    SPLIT_MISMATCH = "split_mismatch"  # FedCVD's split row of this record's ECG_ID has other labels, age or sex


@dataclass
class SourceReport:
    """Counts for one source."""

    name: str
    kind: str
    path: str
    candidates: int = 0  # records found
    loaded: int = 0
    train: int = 0
    test: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records
    label_counts: list[int] = field(default_factory=lambda: [0] * N_CLASSES)  # loaded records per class
    multi_label: int = 0  # loaded records with more than one class
    resampled: int = 0
    sampling_rates: dict[str, int] = field(default_factory=dict)  # loaded records by their rate ("500 Hz")
    padded: int = 0
    truncated: int = 0
    unmapped_codes: dict[str, int] = field(default_factory=dict)  # most frequent codes outside the map
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> a few record ids
    split_unknown: int = 0  # split file entries that name no record of the source (FedCVD: ECG_IDs never reached)
    split_unknown_examples: list[str] = field(default_factory=list)

    def skip(self, reason: SkipReason, record_id: str) -> None:
        """Count one skipped record."""
        self.skipped[reason.value] = self.skipped.get(reason.value, 0) + 1
        ids = self.examples.setdefault(reason.value, [])
        if len(ids) < MAX_EXAMPLES:
            ids.append(record_id)

    def keep(self, classes: tuple[int, ...], *, is_test: bool, method: str, resampled: bool, fs: float) -> None:
        """Count one loaded record, sampled at `fs` Hz in its file."""
        rate = f"{fs:g} Hz"
        self.sampling_rates[rate] = self.sampling_rates.get(rate, 0) + 1
        self.loaded += 1
        self.test += is_test
        self.train += not is_test
        for index in classes:
            self.label_counts[index] += 1
        self.multi_label += len(classes) > 1
        self.padded += method == "padded"
        self.truncated += method == "truncated"
        self.resampled += resampled

    def note_split_unknown(self, entries: list[str]) -> None:
        """Record the split file's entries that matched no record."""
        self.split_unknown = len(entries)
        self.split_unknown_examples = entries[:MAX_EXAMPLES]

    def note_unmapped(self, counts: Counter[str]) -> None:
        """Keep the most frequent codes that mapped to no class."""
        self.unmapped_codes = dict(counts.most_common(MAX_UNMAPPED))

    @property
    def n_skipped(self) -> int:
        """Records skipped for any reason."""
        return sum(self.skipped.values())

    def summary_lines(self) -> list[str]:
        """What loading this source did, as a few lines: found, loaded, skipped by reason, labels per class."""
        labels = " ".join(f"{name}={n}" for name, n in zip(CLASS_NAMES, self.label_counts, strict=True) if n)
        lines = [
            f"{self.name} ({self.kind}, {self.path})",
            f"  found {self.candidates}, loaded {self.loaded} (train {self.train}, test {self.test}), "
            f"skipped {self.n_skipped}",
            f"  skipped by reason: {self.skip_summary()}",
            f"  resampled {self.resampled}, padded {self.padded}, truncated {self.truncated}, "
            f"multi-label {self.multi_label}",
            f"  labels: {labels or 'none'}",
        ]
        if self.sampling_rates:
            rates = ", ".join(f"{rate} {n}" for rate, n in sorted(self.sampling_rates.items(), key=_hertz))
            lines.append(f"  sampling rates: {rates}")
        if self.unmapped_codes:
            lines.append(f"  unmapped codes (most frequent): {self.top_unmapped()}")
        if self.split_unknown:
            examples = ", ".join(self.split_unknown_examples)
            lines.append(f"  split file: {self.split_unknown} entries name no record (e.g. {examples})")
        return lines

    def skip_summary(self) -> str:
        """'reason n, ...' over the skip reasons, or 'none'."""
        return ", ".join(f"{reason} {n}" for reason, n in sorted(self.skipped.items())) or "none"

    def top_unmapped(self, n: int = 8) -> str:
        """The `n` most frequent codes that mapped to no class, with their counts."""
        return ", ".join(f"{code} {count}" for code, count in list(self.unmapped_codes.items())[:n])


def _hertz(item: tuple[str, int]) -> float:
    """A rate's number, to order "400 Hz" before "1000 Hz"."""
    return float(item[0].split()[0])


@dataclass
class LoadReport:
    """Per-source counts of one site's data; `str()` prints them as a table."""

    sources: list[SourceReport]

    @property
    def loaded(self) -> int:
        """Records loaded over all sources."""
        return sum(s.loaded for s in self.sources)

    @property
    def skipped(self) -> dict[str, int]:
        """Skipped records by reason over all sources."""
        total: Counter[str] = Counter()
        for source in self.sources:
            total.update(source.skipped)
        return dict(sorted(total.items()))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (stored next to the cache)."""
        return {"sources": [asdict(s) for s in self.sources]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadReport:
        """Inverse of `to_dict`."""
        return cls([SourceReport(**s) for s in data["sources"]])

    def __str__(self) -> str:
        lines = [line for source in self.sources for line in source.summary_lines()]
        lines.append(f"total: loaded {self.loaded}, skipped {sum(self.skipped.values())}")
        return "\n".join(lines)
