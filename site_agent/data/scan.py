"""One pass over a source: every record is loaded and preprocessed, or skipped and counted with its reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import wfdb

from site_agent.data.config import ManifestSource, PreprocessConfig, PtbxlSource, RecordSource, SphSource
from site_agent.data.label_maps import LabelMap
from site_agent.data.preprocess import preprocess_signal
from site_agent.data.records import STANDARD_LEADS, RecordSkipped, header_fields, read_header, read_signal
from site_agent.data.report import SkipReason, SourceReport
from site_agent.data.sources import (
    PTBXL_DATABASE,
    SPH_METADATA,
    RecordRef,
    Source,
    SourceError,
    header_code_field,
    list_records,
    reading,
    source_label_map,
    split_codes,
)
from site_agent.data.sph import SPH_FS, read_sph_signal
from site_agent.data.split import FedcvdSplit, SplitFile, is_test_record

__all__ = ["LoadedRecord", "check_source", "demographics_ok", "inspect_source", "scan_source"]

_SEXES = {"male", "female", "m", "f"}


def plugin_signal(source: RecordSource, ref: RecordRef) -> tuple[np.ndarray, float]:
    """A plug-in source's signal, checked to be 12 leads x samples; one it cannot read skips the record."""
    try:
        raw, fs = source.read_signal(ref)
        signal = np.asarray(raw, dtype=np.float64)
    except RecordSkipped:
        raise
    except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise RecordSkipped(SkipReason.UNREADABLE, f"signal: {type(exc).__name__}: {exc}") from exc
    if signal.ndim != 2 or signal.shape[0] != len(STANDARD_LEADS):
        raise RecordSkipped(SkipReason.UNREADABLE, f"signal of shape {signal.shape}, not (12 leads, samples)")
    return signal, float(fs)


@dataclass(frozen=True)
class LoadedRecord:
    """A record ready for the cache."""

    record_id: str
    signal: np.ndarray  # (12, signal_len) float32, physical units (mV)
    classes: tuple[int, ...]  # sorted FedCVD class indices, at least one
    is_test: bool


def demographics_ok(age: str | None, sex: str | None) -> bool:
    """FedCVD's rule: 0 < age < 120 and a known sex."""
    try:
        years = float(age or "nan")
    except ValueError:
        return False
    return 0 < years < 120 and (sex or "").strip().lower() in _SEXES


def _split_file(source: Source) -> SplitFile | FedcvdSplit | None:
    """The source's split file (or FedCVD's split folder), read; a missing or malformed one raises SourceError."""
    if source.fedcvd_split is not None:
        with reading(source, "fedcvd_split", source.fedcvd_split):
            return FedcvdSplit(source.fedcvd_split)
    if source.split_file is None:
        return None
    with reading(source, "split_file", source.split_file):
        return SplitFile(source.split_file)


def check_source(source: Source) -> None:
    """Open what `source` names (path, label map, split file) and list its records, reading none of them.

    Anything that cannot be read, or a source that lists no record, raises SourceError naming the setting.
    """
    refs = list_records(source)
    source_label_map(source)
    _split_file(source)
    if not refs:
        raise SourceError(source, "path", f"{source.path} {_no_records(source)}")


def _no_records(source: Source) -> str:
    """What an empty source lacks, in its layout's words."""
    if isinstance(source, RecordSource):
        return "lists no records"
    if isinstance(source, ManifestSource):
        return "lists no records"
    if isinstance(source, SphSource):
        return f"has a {SPH_METADATA} without rows"
    if isinstance(source, PtbxlSource) and (source.path / PTBXL_DATABASE).exists():
        return f"has a {PTBXL_DATABASE} without rows"
    if isinstance(source, PtbxlSource):
        return f"has no {PTBXL_DATABASE} and no *_{source.resolution}.hea records"
    return "holds no WFDB records (.hea headers at any depth)"


class _Scanner:
    """The per-record pipeline of one source; cheap checks run before the signal is read."""

    def __init__(self, source: Source, config: PreprocessConfig, report: SourceReport) -> None:
        self.source = source
        self.config = config
        self.report = report
        self.label_map: LabelMap = source_label_map(source)
        self.split = _split_file(source)
        self.require_demographics = config.require_demographics or source.require_demographics
        self.unmapped: Counter[str] = Counter()
        self.next_fedcvd_id = 0  # FedCVD numbers the records it keeps from 000000, in reading order
        self.fedcvd_taken: set[int] = set()  # ECG_IDs given to a record that matched its row

    def listed_split(self, ref: RecordRef) -> bool:
        """A record's side from a `record,split` file or a manifest's split column, else the seeded hash."""
        if isinstance(self.split, SplitFile):
            listed = self.split.is_test(ref.record_id)
            if listed is None:
                raise RecordSkipped(SkipReason.NOT_IN_SPLIT_FILE)
            return listed
        if ref.split is not None:
            return ref.split == "test"
        return is_test_record(ref.record_id, seed=self.source.seed, test_fraction=self.source.test_fraction)

    def fedcvd_split(self, classes: tuple[int, ...], age: str | None, sex: str | None) -> bool:
        """Give the record the next ECG_ID, as FedCVD numbers the records it keeps, and take that row's side."""
        split = self.split
        assert isinstance(split, FedcvdSplit)
        ecg_id = self.next_fedcvd_id
        self.next_fedcvd_id += 1
        if ecg_id not in split.rows:
            raise RecordSkipped(SkipReason.NOT_IN_SPLIT_FILE, f"ECG_ID {ecg_id:06d}")
        why = split.mismatch(ecg_id, classes, age, sex)
        if why is not None:
            raise RecordSkipped(SkipReason.SPLIT_MISMATCH, why)
        self.fedcvd_taken.add(ecg_id)
        return split.rows[ecg_id].is_test

    def signal(self, ref: RecordRef, header: wfdb.Record | None) -> tuple[np.ndarray, str, bool, float]:
        """The preprocessed signal, its length method, whether it was resampled, and its file's rate."""
        if isinstance(self.source, RecordSource):
            raw, fs = plugin_signal(self.source, ref)
        elif header is None:
            raw, fs = read_sph_signal(ref.path), SPH_FS
        else:
            raw, fs = read_signal(ref.path, header), header.fs
        return (*preprocess_signal(raw, fs, self.config), fs)

    def load(self, ref: RecordRef) -> LoadedRecord:
        if ref.error:
            raise RecordSkipped(SkipReason.UNREADABLE, ref.error)
        header = None if isinstance(self.source, (SphSource, RecordSource)) else read_header(ref.path)
        fields = header_fields(header.comments) if header is not None else {}
        codes = ref.codes if ref.codes is not None else split_codes(fields.get(header_code_field(self.source), ""))
        classes, unmapped = self.label_map.classes_of(codes)
        self.unmapped.update(unmapped)
        if not classes:
            raise RecordSkipped(SkipReason.NO_LABEL, ",".join(codes))
        age = ref.age if ref.age is not None else fields.get("age")
        sex = ref.sex if ref.sex is not None else fields.get("sex")
        if self.require_demographics and not demographics_ok(age, sex):
            raise RecordSkipped(SkipReason.BAD_DEMOGRAPHICS, f"age={age} sex={sex}")
        listed = None if isinstance(self.split, FedcvdSplit) else self.listed_split(ref)  # before the costly read
        signal, method, resampled, fs = self.signal(ref, header)
        is_test = listed if listed is not None else self.fedcvd_split(classes, age, sex)
        self.report.keep(classes, is_test=is_test, method=method, resampled=resampled, fs=fs)
        return LoadedRecord(ref.record_id, signal, classes, is_test)

    def split_unknown(self, refs: list[RecordRef]) -> list[str]:
        """The split file's entries that name no record of the source."""
        if isinstance(self.split, SplitFile):
            return self.split.unknown(ref.record_id for ref in refs)
        if isinstance(self.split, FedcvdSplit):
            return [f"{ecg_id:06d}" for ecg_id in sorted(self.split.rows) if ecg_id not in self.fedcvd_taken]
        return []


def scan_source(source: Source, config: PreprocessConfig, report: SourceReport) -> Iterator[LoadedRecord]:
    """Yield each usable record of `source`, counting every record in `report` (kept or skipped with a reason)."""
    scanner = _Scanner(source, config, report)
    refs = list_records(source)
    report.candidates = len(refs)
    for ref in refs:
        try:
            loaded = scanner.load(ref)
        except RecordSkipped as skipped:
            report.skip(skipped.reason, ref.record_id)
            continue
        yield loaded
    report.note_unmapped(scanner.unmapped)
    report.note_split_unknown(scanner.split_unknown(refs))


def inspect_source(source: Source, config: PreprocessConfig) -> SourceReport:
    """Run the whole pipeline over `source` without caching anything; return its counts."""
    report = SourceReport(name=source.display_name, kind=source.kind, path=str(source.path))
    for _ in scan_source(source, config, report):
        pass
    return report
