"""A site's data-readiness survey: each record of its sources, as the files give it, counted into a SiteSurvey.

Every record goes where the site's loader puts it, through the loader's own scanner (scan.py: its
label map, split and skip reasons): `train` or `test` when kept, else `excluded` with its reason. It
is described from its raw files, before any preprocessing: the 20 classes its codes map to, its
sampling rate, duration and lead set from its header (an SPH file's shape; a plug-in's signal), age
and sex from the source's table or header, and the quality flags of its raw signal (quality.py),
read for excluded records too where it can be. A record that cannot be read is counted, as far as
it is known, never raised. `RecordFacts` stay at the site; `count_survey` makes the exact survey,
which shared/wire/survey_release.py turns into what may leave it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import wfdb

from shared.labels import CLASS_NAMES
from shared.wire.survey import Cell, SiteSurvey, age_key, all_cells, duration_key, rate_key, sex_key
from site_agent.data.config import DataSourceConfig, PreprocessConfig, RecordSource, SphSource
from site_agent.data.preprocess import preprocess_signal
from site_agent.data.quality import quality_flags
from site_agent.data.records import STANDARD_LEADS, RecordSkipped, header_fields, read_header, read_signal
from site_agent.data.report import SourceReport
from site_agent.data.scan import _Scanner, check_source, plugin_signal
from site_agent.data.sources import RecordRef, Source, header_code_field, list_records, split_codes
from site_agent.data.sph import SPH_FS, read_sph_signal

__all__ = ["RecordFacts", "count_survey", "lead_set_key", "survey_records", "survey_site"]

_STANDARD = {lead.upper() for lead in STANDARD_LEADS}


@dataclass(frozen=True)
class RecordFacts:
    """What the survey knows of one record, in the survey's keys where it bins; it never leaves the site."""

    group: str  # train, test or excluded
    reason: str | None  # the loader's skip reason of an excluded record
    classes: tuple[int, ...] | None  # the classes its codes map to; None where its codes could not be read
    fs: float | None  # Hz, as its header (or source) gives it
    n_samples: int | None
    lead_set: str  # a key of shared.wire.survey.LEAD_SET_KEYS
    quality: frozenset[str] | None  # its quality flags; None where no signal of 12 leads could be read
    age: str  # a key of AGE_KEYS
    sex: str  # a key of SEX_KEYS


def lead_set_key(names: Sequence[str] | None) -> str:
    """The lead-set key of a header's channel names: the 12 standard leads (any case) once each, with others or not."""
    channels = [str(name).strip().upper() for name in names or []]
    found = Counter(name for name in channels if name in _STANDARD)
    if any(count > 1 for count in found.values()):
        return "duplicate standard"
    if len(found) < len(_STANDARD):
        return "missing standard"
    return "12 standard + other" if len(channels) > len(_STANDARD) else "12 standard"


class _SurveyScanner(_Scanner):
    """The loader's scanner, keeping the raw signal it reads of the record at hand."""

    def __init__(self, source: Source, config: PreprocessConfig) -> None:
        report = SourceReport(name=source.display_name, kind=source.kind, path=str(source.path))
        super().__init__(source, config, report)
        self.raw: tuple[np.ndarray, float] | None = None
        self.header: wfdb.Record | None = None  # the header the loader read, where it went on to the signal
        self.tried_signal = False

    def raw_signal(self, ref: RecordRef, header: wfdb.Record | None) -> tuple[np.ndarray, float]:
        """The 12 standard leads in mV as the file gives them, and their rate; RecordSkipped where unreadable."""
        if isinstance(self.source, RecordSource):
            return plugin_signal(self.source, ref)
        if header is None:
            return read_sph_signal(ref.path), SPH_FS
        return read_signal(ref.path, header), header.fs

    def signal(self, ref: RecordRef, header: wfdb.Record | None) -> tuple[np.ndarray, str, bool, float]:
        """The loader's preprocessing of the record, its raw signal kept in `raw` first."""
        self.tried_signal, self.header = True, header
        self.raw = self.raw_signal(ref, header)
        raw, fs = self.raw
        return (*preprocess_signal(raw, fs, self.config), fs)

    def place(self, ref: RecordRef) -> tuple[str, str | None]:
        """(group, skip reason) of the record, as the loader decides them."""
        self.raw, self.header, self.tried_signal = None, None, False
        try:
            loaded = self.load(ref)
        except RecordSkipped as skipped:
            return "excluded", skipped.reason.value
        return ("test" if loaded.is_test else "train"), None


def _header(source: Source, ref: RecordRef) -> wfdb.Record | None:
    """The record's WFDB header; None for SPH and plug-in sources, a malformed listing or an unreadable header."""
    if ref.error or isinstance(source, SphSource | RecordSource):
        return None
    try:
        return read_header(ref.path)
    except RecordSkipped:
        return None


def _signal_facts(
    scanner: _SurveyScanner, ref: RecordRef, header: wfdb.Record | None
) -> tuple[float | None, int | None, str, frozenset[str] | None]:
    """(rate, samples, lead-set key, quality flags) from the header and the raw signal (read here if not yet)."""
    wfdb_source = not isinstance(scanner.source, SphSource | RecordSource)
    raw = scanner.raw
    if raw is None and not scanner.tried_signal and not ref.error and (header is not None or not wfdb_source):
        try:
            raw = scanner.raw_signal(ref, header)
        except RecordSkipped:
            raw = None
    quality = quality_flags(raw[0], float(raw[1])) if raw is not None else None
    if header is not None:
        fs = float(header.fs) if header.fs is not None else None
        samples = int(header.sig_len) if header.sig_len is not None else None
        return fs, samples, lead_set_key(header.sig_name), quality
    if raw is not None:
        return float(raw[1]), int(raw[0].shape[1]), "12 standard", quality
    known_rate = SPH_FS if isinstance(scanner.source, SphSource) and not ref.error else None
    return known_rate, None, "unknown", None


def _facts(scanner: _SurveyScanner, ref: RecordRef) -> RecordFacts:
    """One record placed by the loader's rules and described from its raw files."""
    group, reason = scanner.place(ref)
    header = scanner.header if scanner.header is not None else _header(scanner.source, ref)
    fields = header_fields(header.comments) if header is not None else {}
    codes = ref.codes
    if codes is None and header is not None:
        codes = split_codes(fields.get(header_code_field(scanner.source), ""))
    classes = scanner.label_map.classes_of(codes)[0] if codes is not None else None
    fs, samples, lead_set, quality = _signal_facts(scanner, ref, header)
    age = ref.age if ref.age is not None else fields.get("age")
    sex = ref.sex if ref.sex is not None else fields.get("sex")
    return RecordFacts(group, reason, classes, fs, samples, lead_set, quality, age_key(age), sex_key(sex))


def survey_records(
    sources: Sequence[DataSourceConfig] | DataSourceConfig, config: PreprocessConfig | None = None
) -> Iterator[RecordFacts]:
    """The facts of every record of `sources`, in the loader's order; a source that cannot be read raises SourceError.

    `config` is the site's preprocessing (its `require_demographics` decides which records are kept).
    """
    source_list = list(sources) if isinstance(sources, Sequence) else [sources]
    for source in source_list:
        check_source(source)
    for source in source_list:
        scanner = _SurveyScanner(source, config or PreprocessConfig())
        for ref in list_records(source):
            yield _facts(scanner, ref)


def count_survey(facts: Iterable[RecordFacts]) -> SiteSurvey:
    """The exact survey of these records: every count of every group and table (shared/wire/survey.py)."""
    cells: dict[Cell, int] = dict.fromkeys(all_cells(), 0)
    for fact in facts:
        group = fact.group
        touched = [("records", "records"), ("lead_set", fact.lead_set), ("age", fact.age), ("sex", fact.sex)]
        touched += [("sampling_rate", rate_key(fact.fs)), ("duration", duration_key(fact.n_samples, fact.fs))]
        touched += [("labels", CLASS_NAMES[index]) for index in fact.classes or ()]
        flags = fact.quality if fact.quality is not None else {"not_assessed"}
        touched += [("quality", flag) for flag in sorted(flags)]
        if group == "excluded":
            touched.append(("reason", str(fact.reason)))
        for table, key in touched:
            cells[(group, table, key)] += 1
    return SiteSurvey.from_cells(dict(cells))


def survey_site(
    sources: Sequence[DataSourceConfig] | DataSourceConfig, config: PreprocessConfig | None = None
) -> SiteSurvey:
    """The exact survey of a site's sources, never to leave it as it is: release it (survey_release.release) first."""
    return count_survey(survey_records(sources, config))
