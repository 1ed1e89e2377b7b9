"""What of a site's survey leaves it: optional discrete Gaussian noise on every count, then suppression.

Suppression (`suppress`, at the site, before anything leaves), group by group, with n = min_records:

- a group of 1..n-1 records is hidden whole (its records and every cell); a group of 0 shows its 0s
  (with noise, a group's noisy records may be 0 and a cell not: such a cell follows the rules below);
- binary table (labels, quality): a count c shows only where c and its complement (the group's records
  less c) are both >= n, or in a recording table 0: a complement of 1..n-1 would reveal that small count
  by subtraction from the group's records;
- partition (sampling rate, duration, lead set, age, sex, reason): the cells below n are hidden; then,
  while the hidden cells sum to less than n, the smallest shown non-zero cell is hidden too (ties: the
  first key). With the group's records shown, the hidden cells' sum is known (records less the shown
  cells): this keeps it from being one hidden cell's value, or a small count itself;
- zeros: a *patient* table (labels, age, sex) hides 0 like any small count, and so, by the complement
  rule, a count equal to the group's records: "no patient of this split is female", "every one has
  NORM" tells something of every patient in it, which a threshold on the other cells cannot prevent.
  Hiding 0 also keeps the marker from saying "at least one record". Its "unknown" key shows 0 (that
  every record gives an age says how complete the data are, nothing of a patient). A *recording*
  table shows 0: that no record was taken at 250 Hz or clipped says nothing of a patient, and hiding
  such zeros would hide most of these tables whole (a site usually has one rate and one lead set).

Every hidden count is the one marker SUPPRESSED, never "< n": the complement and partition rules
hide counts of n or more too, and marking those apart would tell which of the others are small.

Scope: each table is protected against its group's records and its own cells; relations between
tables (one record counted in several) are not audited. Where they matter, the terms ask for noise:
its epsilon (shared/study/survey.py) covers every count, and suppression, which then reads only the
noisy counts, is post-processing.

Noise (`add_noise`): N_Z(0, sigma^2) added to each count, all cells in the vocabulary's order, from the
exact sampler (shared/privacy/discrete.py), then clamped at 0. Adding or removing one record moves the
vector of counts by at most `SURVEY_L2_SENSITIVITY` = sqrt(MAX_CONTRIBUTIONS) in L2 (shared/wire/survey.py):
it adds 1 to its group's records, to one key of each partition of its group, to each of its labels (up
to 20) and to each of its quality flags (up to 5): 1 + 20 + 6 + 5 = 32 cells for an excluded record.
Replacing one record by another moves it by at most sqrt(2 * 32) = 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from shared.errors import MetricsError, PrivacyInputError
from shared.privacy.discrete import DiscreteGaussian
from shared.wire.survey import GROUPS, UNKNOWN, Cell, SiteSurvey, SurveyTable, tables_of

__all__ = ["add_noise", "hidden_binary", "hidden_partition", "release", "release_problem", "suppress"]


def _small(value: int, min_records: int, *, hide_zero: bool) -> bool:
    """Whether a count may not show: below min_records, a 0 excepted where zeros show."""
    return value < min_records and (hide_zero or value != 0)


def _hides_zero(table: SurveyTable, key: str) -> bool:
    """Whether a 0 under `key` is hidden: in a patient table, but for "unknown" (how complete the data are)."""
    return table.patient and key != UNKNOWN


def hidden_partition(values: Sequence[int], min_records: int, *, hide_zero: Sequence[bool]) -> list[bool]:
    """Which cells of a partition are hidden: the small ones, then the smallest others until the hidden sum >= n."""
    hidden = [_small(value, min_records, hide_zero=zero) for value, zero in zip(values, hide_zero, strict=True)]
    while any(hidden) and sum(v for v, h in zip(values, hidden, strict=True) if h) < min_records:
        shown = [(value, index) for index, value in enumerate(values) if not hidden[index] and value > 0]
        if not shown:
            break  # every non-zero cell is hidden: their sum is the group's records, hidden with it
        hidden[min(shown)[1]] = True
    return hidden


def hidden_binary(value: int, records: int, min_records: int, *, hide_zero: bool) -> bool:
    """Whether a binary count is hidden: it, or what the group's records leave outside it, is small."""
    return _small(value, min_records, hide_zero=hide_zero) or _small(records - value, min_records, hide_zero=hide_zero)


def _suppress_group(cells: dict[Cell, int | None], group: str, min_records: int) -> None:
    """Hide in place what `group`'s cells may not show (see the module)."""
    records = cells[(group, "records", "records")]
    assert records is not None
    whole = _small(records, min_records, hide_zero=False)
    if whole:
        cells[(group, "records", "records")] = None
    for table in tables_of(group):
        keys = [(group, table.name, key) for key in table.keys]
        values = [int(cells[cell] or 0) for cell in keys]
        zeros = [records != 0 and _hides_zero(table, key) for key in table.keys]  # 0 records: nothing to hide
        if whole:
            hidden = [True] * len(keys)
        elif table.partition:
            hidden = hidden_partition(values, min_records, hide_zero=zeros)
        else:
            hidden = [hidden_binary(v, records, min_records, hide_zero=z) for v, z in zip(values, zeros, strict=True)]
        for cell, hide in zip(keys, hidden, strict=True):
            if hide:
                cells[cell] = None


def suppress(survey: SiteSurvey, min_records: int) -> SiteSurvey:
    """The survey as it may leave the site: every count that may not show replaced by SUPPRESSED (see the module)."""
    if survey.min_records is not None:
        raise MetricsError("this survey was suppressed already")
    if min_records < 1:
        raise PrivacyInputError(f"min_records is at least 1, got {min_records}")
    cells = survey.cells()
    for group in GROUPS:
        _suppress_group(cells, group, min_records)
    return SiteSurvey.from_cells(cells, min_records=min_records, noise_sigma=survey.noise_sigma)


def add_noise(survey: SiteSurvey, sigma: float, *, key: bytes | None = None) -> SiteSurvey:
    """Each count plus N_Z(0, sigma^2), clamped at 0; `key` (32 bytes) makes the draws reproducible, else the OS's."""
    if survey.min_records is not None or survey.noise_sigma is not None:
        raise MetricsError("noise goes on an exact survey, before suppression")
    if not sigma > 0:
        raise PrivacyInputError(f"the noise's sigma is positive, got {sigma}")
    cells = survey.cells()
    noise = DiscreteGaussian(key).sample(len(cells), Fraction(sigma) ** 2)
    noisy = {
        cell: max(int(value or 0) + int(draw), 0) for (cell, value), draw in zip(cells.items(), noise, strict=True)
    }
    return SiteSurvey.from_cells(noisy, noise_sigma=sigma)


def release(
    survey: SiteSurvey, *, min_records: int, noise_sigma: float | None = None, key: bytes | None = None
) -> SiteSurvey:
    """An exact survey as it leaves the site: noised when `noise_sigma` is given, then suppressed."""
    noisy = survey if noise_sigma is None else add_noise(survey, noise_sigma, key=key)
    return suppress(noisy, min_records)


def release_problem(survey: SiteSurvey, *, min_records: int, noise_sigma: float | None) -> str | None:
    """Why a survey a site sent is not released as these settings (the study's terms) ask; None when it is."""
    if survey.min_records is None:
        return "the survey was not suppressed: a site sends only a released survey"
    if survey.min_records != min_records:
        return f"the survey was suppressed below {survey.min_records} records, the terms say {min_records}"
    if survey.noise_sigma != noise_sigma:
        return f"the survey's noise sigma is {survey.noise_sigma}, the terms say {noise_sigma}"
    return None
