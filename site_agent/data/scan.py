"""One pass over a source: every record is loaded and preprocessed, or skipped and counted with its reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shared.labels import LabelMap
from site_agent.data.config import ManifestSource, PreprocessConfig, PtbxlSource
from site_agent.data.preprocess import preprocess_signal
from site_agent.data.records import RecordSkipped, header_fields, read_header, read_signal
from site_agent.data.report import SkipReason, SourceReport
from site_agent.data.sources import (
    PTBXL_DATABASE,
    RecordRef,
    Source,
    SourceError,
    header_code_field,
    list_records,
    reading,
    source_label_map,
    split_codes,
)
from site_agent.data.split import SplitFile, is_test_record

__all__ = ["LoadedRecord", "check_source", "demographics_ok", "inspect_source", "scan_source"]

_SEXES = {"male", "female", "m", "f"}


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


def _split_file(source: Source) -> SplitFile | None:
    """The source's split file, read; a missing or malformed one raises SourceError."""
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
    if isinstance(source, ManifestSource):
        return "lists no records"
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
        self.split_file = _split_file(source)
        self.unmapped: Counter[str] = Counter()

    def is_test(self, ref: RecordRef) -> bool:
        if self.split_file is not None:
            listed = self.split_file.is_test(ref.record_id)
            if listed is None:
                raise RecordSkipped(SkipReason.NOT_IN_SPLIT_FILE)
            return listed
        if ref.split is not None:
            return ref.split == "test"
        return is_test_record(ref.record_id, seed=self.source.seed, test_fraction=self.source.test_fraction)

    def load(self, ref: RecordRef) -> LoadedRecord:
        if ref.error:
            raise RecordSkipped(SkipReason.UNREADABLE, ref.error)
        header = read_header(ref.path)
        fields = header_fields(header.comments)
        codes = ref.codes if ref.codes is not None else split_codes(fields.get(header_code_field(self.source), ""))
        classes, unmapped = self.label_map.classes_of(codes)
        self.unmapped.update(unmapped)
        if not classes:
            raise RecordSkipped(SkipReason.NO_LABEL, ",".join(codes))
        is_test = self.is_test(ref)
        age = ref.age if ref.age is not None else fields.get("age")
        sex = ref.sex if ref.sex is not None else fields.get("sex")
        if self.config.require_demographics and not demographics_ok(age, sex):
            raise RecordSkipped(SkipReason.BAD_DEMOGRAPHICS, f"age={age} sex={sex}")
        signal, method, resampled = preprocess_signal(read_signal(ref.path, header), header.fs, self.config)
        self.report.keep(classes, is_test=is_test, method=method, resampled=resampled, fs=header.fs)
        return LoadedRecord(ref.record_id, signal, classes, is_test)


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


def inspect_source(source: Source, config: PreprocessConfig) -> SourceReport:
    """Run the whole pipeline over `source` without caching anything; return its counts."""
    report = SourceReport(name=source.display_name, kind=source.kind, path=str(source.path))
    for _ in scan_source(source, config, report):
        pass
    return report
