"""A site's data-readiness survey as it crosses the network: fixed tables of counts, never a per-record value.

A survey describes a site's records in three groups: `train` and `test` (the records its loader keeps,
split as the site splits them) and `excluded` (those it skips, by reason). Each group has its number
of records and the tables of `TABLES`, every one with a fixed set of keys (the vocabulary below,
`SURVEY_VERSION`): which keys a report holds never depends on the data, so that neither the presence
of a key nor the noise's dimension tells anything. A table is a *partition* (each record of the
group in exactly one key: the cells sum to the group's records) or *binary* (a count of records
with the attribute; its complement is the group's records less it).

A count is a non-negative integer or `SUPPRESSED`. A site computes its survey exactly
(`min_records` None), then releases it (shared/wire/survey_release.py): optional discrete Gaussian
noise, then suppression; a released survey shows no count below its `min_records` except the zeros
of recording tables and of "unknown" keys (`SurveyTable.patient`). The binning functions below
define each key's meaning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Final, Literal

from pydantic import Field, StrictInt, model_validator

from shared.errors import MetricsError
from shared.labels import CLASS_NAMES
from shared.wire.protocol import _Input

__all__ = [
    "AGE_KEYS",
    "DURATION_KEYS",
    "GROUPS",
    "LEAD_SET_KEYS",
    "MAX_CONTRIBUTIONS",
    "QUALITY_FLAGS",
    "QUALITY_KEYS",
    "RATE_KEYS",
    "REASON_KEYS",
    "SEX_KEYS",
    "SUPPRESSED",
    "SURVEY_L2_SENSITIVITY",
    "SURVEY_VERSION",
    "TABLES",
    "UNKNOWN",
    "Cell",
    "Count",
    "GroupSurvey",
    "SiteSurvey",
    "SurveyTable",
    "age_key",
    "all_cells",
    "duration_key",
    "rate_key",
    "sex_key",
    "tables_of",
]

SURVEY_VERSION: Final = 1  # the vocabulary below; a new key or table is a new version
SUPPRESSED: Final = "suppressed"  # a count not shown (survey_release.suppress says when)
UNKNOWN: Final = "unknown"  # the key of records whose rate, duration, lead set, age or sex is not known
MAX_COUNT = 10**9
GROUPS = ("train", "test", "excluded")

# Sampling rates: the usual rates of ECG archives, each within 0.01 Hz; any other rate is "other".
COMMON_RATES = (100, 125, 128, 200, 250, 257, 300, 360, 400, 500, 1000, 2000)
RATE_KEYS = (*(f"{rate} Hz" for rate in COMMON_RATES), "other", UNKNOWN)
# Durations (samples / rate): FedCVD keeps 10 s, pads shorter records and truncates longer ones.
DURATION_KEYS = ("<5s", "5-10s", "10s", "10-20s", "20-60s", ">60s", UNKNOWN)
# The 12 standard leads (case-insensitive names): all, once each, with or without other channels; else why not.
LEAD_SET_KEYS = ("12 standard", "12 standard + other", "missing standard", "duplicate standard", UNKNOWN)
# Signal-quality flags (thresholds: site_agent/data/quality.py); `not_assessed`: no signal of 12 leads read.
QUALITY_FLAGS = ("flat_lead", "non_finite", "clipped", "amplitude_outlier", "baseline_wander")
QUALITY_KEYS = (*QUALITY_FLAGS, "not_assessed")
_AGE_BANDS = ((18, "<18"), (40, "18-39"), (60, "40-59"), (80, "60-79"), (math.inf, "80+"))  # (below, key)
AGE_KEYS = (*(key for _, key in _AGE_BANDS), UNKNOWN)
SEX_KEYS = ("F", "M", UNKNOWN)
# Why a record is excluded: the loader's skip reasons (site_agent/data/report.py SkipReason), in its order.
REASON_KEYS = (
    "unreadable",
    "missing_lead",
    "duplicate_lead",
    "unknown_units",
    "bad_sampling_rate",
    "empty",
    "non_finite",
    "all_zero",
    "no_label",
    "bad_demographics",
    "not_in_split_file",
    "split_mismatch",
)


@dataclass(frozen=True)
class SurveyTable:
    """One table of every group (or of `groups` only): its fixed keys and how they relate to the group's records."""

    name: str
    keys: tuple[str, ...]
    partition: bool  # each record in exactly one key: the cells sum to the group's records
    patient: bool  # describes the patient (labels, age, sex): a 0 (but of "unknown") or a full count is hidden too
    per_record: int  # the most counts of this table one record adds 1 to
    groups: tuple[str, ...] = GROUPS


TABLES = (
    SurveyTable("labels", CLASS_NAMES, partition=False, patient=True, per_record=len(CLASS_NAMES)),
    SurveyTable("sampling_rate", RATE_KEYS, partition=True, patient=False, per_record=1),
    SurveyTable("duration", DURATION_KEYS, partition=True, patient=False, per_record=1),
    SurveyTable("lead_set", LEAD_SET_KEYS, partition=True, patient=False, per_record=1),
    # a record not assessed has no flag: at most the five flags
    SurveyTable("quality", QUALITY_KEYS, partition=False, patient=False, per_record=len(QUALITY_FLAGS)),
    SurveyTable("age", AGE_KEYS, partition=True, patient=True, per_record=1),
    SurveyTable("sex", SEX_KEYS, partition=True, patient=True, per_record=1),
    SurveyTable("reason", REASON_KEYS, partition=True, patient=False, per_record=1, groups=("excluded",)),
)

# One record adds 1 to its group's records and at most `per_record` counts of each of its group's tables, and
# to nothing else: adding or removing it moves the vector of all counts by at most sqrt(MAX_CONTRIBUTIONS) in L2.
MAX_CONTRIBUTIONS = max(1 + sum(t.per_record for t in TABLES if group in t.groups) for group in GROUPS)
SURVEY_L2_SENSITIVITY = math.sqrt(MAX_CONTRIBUTIONS)

Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)] | Literal["suppressed"]
Cell = tuple[str, str, str]  # (group, table, key); a group's records are (group, "records", "records")


def tables_of(group: str) -> tuple[SurveyTable, ...]:
    """The tables a group holds, in order."""
    return tuple(table for table in TABLES if group in table.groups)


def all_cells() -> tuple[Cell, ...]:
    """Every cell of a survey, in the vocabulary's order: each group's records, then its tables' keys."""
    return tuple(
        cell
        for group in GROUPS
        for cell in [(group, "records", "records")] + [(group, t.name, key) for t in tables_of(group) for key in t.keys]
    )


def rate_key(fs: float | None) -> str:
    """The sampling-rate key of a rate in Hz: a common rate, "other", or "unknown" (none, not finite, not positive)."""
    if fs is None or not math.isfinite(fs) or fs <= 0:
        return UNKNOWN
    near = min(COMMON_RATES, key=lambda rate: abs(rate - fs))
    return f"{near} Hz" if abs(near - fs) <= 0.01 else "other"


def duration_key(n_samples: int | None, fs: float | None) -> str:
    """The duration band of `n_samples` at `fs` Hz; "10s" is 10 s to within half a sample."""
    if n_samples is None or n_samples < 0 or rate_key(fs) == UNKNOWN:
        return UNKNOWN
    assert fs is not None
    seconds = n_samples / fs
    if abs(n_samples - 10 * fs) <= 0.5:
        return "10s"
    if seconds < 10:
        return "<5s" if seconds < 5 else "5-10s"
    return "10-20s" if seconds <= 20 else "20-60s" if seconds <= 60 else ">60s"


def age_key(age: str | float | None) -> str:
    """The age band of an age in years as a source records it; PTB-XL writes 300 for "over 89", which is 80+.

    Not a number, not finite or negative: "unknown".
    """
    try:
        years = float(age) if age is not None else math.nan
    except ValueError:
        return UNKNOWN
    if not math.isfinite(years) or years < 0:
        return UNKNOWN
    return next(key for limit, key in _AGE_BANDS if years < limit)


def sex_key(sex: str | None) -> str:
    """The sex key: "F" or "M" from the spellings sources use (Female, f, woman ...), else "unknown"."""
    text = (sex or "").strip().lower()
    return "F" if text in ("f", "female", "w", "woman") else "M" if text in ("m", "male", "man") else UNKNOWN


class GroupSurvey(_Input):
    """One group's counts: its records, and each of its tables as {key: count} with exactly the table's keys."""

    records: Count
    tables: dict[str, dict[str, Count]]


def _check_keys(name: str, group: GroupSurvey) -> None:
    """MetricsError unless the group holds exactly its tables, each with exactly its keys."""
    wanted = {table.name: table for table in tables_of(name)}
    if set(group.tables) != set(wanted):
        raise MetricsError(f"group {name}: tables {sorted(group.tables)}, expected {sorted(wanted)}")
    for table_name, counts in group.tables.items():
        if set(counts) != set(wanted[table_name].keys):
            raise MetricsError(f"group {name}, table {table_name}: keys {sorted(counts)} are not the table's")


def _check_exact(name: str, group: GroupSurvey) -> None:
    """MetricsError where an exact group does not add up: a partition not summing to the records, a count above them."""
    records = group.records
    assert isinstance(records, int)
    for table in tables_of(name):
        counts = [group.tables[table.name][key] for key in table.keys]
        if SUPPRESSED in counts:
            raise MetricsError(f"group {name}, table {table.name}: an exact survey suppresses nothing")
        values = [int(count) for count in counts]
        if table.partition and sum(values) != records:
            raise MetricsError(f"group {name}, table {table.name}: its cells sum to {sum(values)}, not {records}")
        if max(values, default=0) > records:
            raise MetricsError(f"group {name}, table {table.name}: a count above the group's {records} records")


class SiteSurvey(_Input):
    """A site's survey: its three groups, and how it was released (exact: `min_records` and `noise_sigma` None).

    An exact survey adds up (every partition sums to its group's records); a released one shows no
    count below `min_records` but the zeros of recording tables; with `noise_sigma`, every count
    carried N_Z(0, noise_sigma^2) before suppression (and was clamped at 0).
    """

    version: Literal[1] = SURVEY_VERSION
    groups: dict[str, GroupSurvey]
    min_records: StrictInt | None = Field(None, ge=1, le=1_000_000)
    noise_sigma: float | None = Field(None, gt=0, le=1e6)

    @model_validator(mode="after")
    def _valid(self) -> SiteSurvey:
        if tuple(sorted(self.groups)) != tuple(sorted(GROUPS)):
            raise MetricsError(f"a survey has the groups {', '.join(GROUPS)}, got {sorted(self.groups)}")
        for name, group in self.groups.items():
            _check_keys(name, group)
            if self.min_records is None and self.noise_sigma is None:
                if group.records == SUPPRESSED:
                    raise MetricsError(f"group {name}: an exact survey suppresses nothing")
                _check_exact(name, group)
        if self.min_records is not None:
            _check_released(self)
        return self

    def cells(self) -> dict[Cell, int | None]:
        """Every count by (group, table, key) in the vocabulary's order, None where suppressed."""
        cells: dict[Cell, int | None] = {}
        for group, table, key in all_cells():
            counts = self.groups[group]
            count = counts.records if table == "records" else counts.tables[table][key]
            cells[(group, table, key)] = None if count == SUPPRESSED else int(count)
        return cells

    @classmethod
    def from_cells(
        cls, cells: Mapping[Cell, int | None], *, min_records: int | None = None, noise_sigma: float | None = None
    ) -> SiteSurvey:
        """The survey of `cells` (None: suppressed), validated as released with these settings."""

        def count(cell: Cell) -> int | str:
            value = cells[cell]
            return SUPPRESSED if value is None else value

        groups = {
            name: GroupSurvey(
                records=count((name, "records", "records")),
                tables={t.name: {key: count((name, t.name, key)) for key in t.keys} for t in tables_of(name)},
            )
            for name in GROUPS
        }
        return cls(groups=groups, min_records=min_records, noise_sigma=noise_sigma)


def _check_released(survey: SiteSurvey) -> None:
    """MetricsError where a released survey shows a count below its min_records (but a 0 where zeros show)."""
    assert survey.min_records is not None
    patient = {table.name for table in TABLES if table.patient}
    cells = survey.cells()
    for (group, table, key), value in cells.items():
        zero_shows = table not in patient or key == UNKNOWN or cells[(group, "records", "records")] == 0
        if value is None or value >= survey.min_records or (value == 0 and zero_shows):
            continue
        raise MetricsError(f"{group}.{table}.{key} shows {value}, below min_records {survey.min_records}")
