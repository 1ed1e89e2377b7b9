"""Data-readiness surveys pooled over sites: per-site and pooled tables of counts, a suppressed count kept hidden.

The input is each site's released counts by cell (group, table, key), None where the site suppressed
one: `shared.wire.survey.SiteSurvey.cells()`, plain data here as in summaries.py. A column pools one
site's counts over the chosen groups (train, test, excluded or all); the pooled column pools every
site's. A pool whose counts were all shown is their exact sum. A pool that holds a suppressed count
shows the sum of the others as a lower bound, "≥ 120": a hidden count is at least 0, and it may be
large (a site hides large counts too, so that a small one cannot be worked out), so no bound above
is claimed. Every figure is thus a sum of counts the sites showed, and with it how many were hidden:
subtracting one figure from another can only give another such sum, never a hidden count. A pool
that would only say "≥ 0" (its shown counts, if any, all 0) shows "–". With noise, each count a site
showed carries its N_Z(0, sigma^2) (clamped at 0), so a pool of k counts carries noise of variance k sigma^2.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.errors import MetricsError

__all__ = ["HIDDEN", "LOWER_BOUND", "PooledCount", "SurveyRow", "pool", "survey_rows", "survey_text"]

HIDDEN = "–"  # a pool of suppressed counts only
LOWER_BOUND = "≥"  # before the sum of the shown counts of a pool that also holds suppressed ones
GROUP_NAMES = ("train", "test", "excluded")
_Cell = tuple[str, str, str]  # (group, table, key), as shared.wire.survey.Cell


@dataclass(frozen=True)
class PooledCount:
    """A sum of counts as far as it can be shown: the sum of those shown, and how many were hidden."""

    shown: int  # the sum of the counts that were shown
    hidden: int  # how many of the pooled counts were suppressed
    counts: int  # how many counts were pooled

    @property
    def exact(self) -> bool:
        """Whether the pool is the exact sum of its counts: none was hidden."""
        return self.hidden == 0

    def text(self) -> str:
        """'1,234' exact, '≥1,234' a lower bound, '–' where it would say only '≥0' (every count shown was 0)."""
        if self.hidden and not self.shown:
            return HIDDEN
        return f"{self.shown:,}" if self.exact else f"{LOWER_BOUND}{self.shown:,}"


def pool(values: Iterable[int | None]) -> PooledCount:
    """The pool of these counts, None standing for a suppressed one."""
    items = list(values)
    return PooledCount(
        shown=sum(value for value in items if value is not None),
        hidden=sum(value is None for value in items),
        counts=len(items),
    )


@dataclass(frozen=True)
class SurveyRow:
    """One row of a survey table: a table's key, pooled per site (in the sites' order) and over all of them."""

    table: str
    key: str
    sites: tuple[PooledCount, ...]
    pooled: PooledCount


def _row_order(cells: Iterable[_Cell], groups: Sequence[str]) -> list[tuple[str, str]]:
    """The (table, key) rows of these groups' cells, in the order they first appear."""
    return list(dict.fromkeys((table, key) for group, table, key in cells if group in groups))


def survey_rows(
    sites: Mapping[str, Mapping[_Cell, int | None]], groups: Sequence[str] = GROUP_NAMES
) -> list[SurveyRow]:
    """The rows of the survey table of `groups`: each (table, key) pooled per site and over all sites.

    Every site must report the same cells (one version of the vocabulary); ValueError otherwise.
    """
    if not sites:
        raise MetricsError("pooling a survey needs at least one site's report")
    unknown = [group for group in groups if group not in GROUP_NAMES]
    if unknown or not groups:
        raise MetricsError(f"the groups of a survey are {', '.join(GROUP_NAMES)}, got {list(groups)}")
    reports = list(sites.values())
    cells = set(reports[0])
    for name, report in sites.items():
        if set(report) != cells:
            raise MetricsError(f"site {name!r} reports other cells than {next(iter(sites))!r}: another survey version")
    rows = []
    for table, key in _row_order(reports[0], groups):
        wanted = [(group, table, key) for group in groups if (group, table, key) in cells]
        per_site = tuple(pool(report[cell] for cell in wanted) for report in reports)
        rows.append(SurveyRow(table, key, per_site, pool(report[cell] for report in reports for cell in wanted)))
    return rows


def survey_text(
    sites: Mapping[str, Mapping[_Cell, int | None]],
    *,
    groups: Sequence[str] = GROUP_NAMES,
    min_records: int,
    noise_sigma: float | None = None,
) -> str:
    """The survey of `groups` as a plain-text table (a row per table key, a column per site and the pooled one).

    Under it, what its marks mean: the CLI prints it as it is (or the rows, `survey_rows`, as a rich table).
    """
    rows = survey_rows(sites, groups)
    header = ["table", "key", *sites, "pooled"]
    body = [[row.table, row.key, *(count.text() for count in row.sites), row.pooled.text()] for row in rows]
    widths = [max(len(line[column]) for line in [header, *body]) for column in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        left = [cell.ljust(width) for cell, width in zip(cells[:2], widths, strict=False)]
        right = [cell.rjust(width) for cell, width in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(left + right).rstrip()

    legend = [
        f"groups: {', '.join(groups)}",
        f"{HIDDEN} suppressed: fewer than {min_records} records, or hidden so that no such count can be worked out",
        f"{LOWER_BOUND}n: the sum of the counts shown; some were suppressed",
    ]
    if noise_sigma is not None:
        legend.append(f"each site's counts carry discrete Gaussian noise of sigma {noise_sigma:g}")
    return "\n".join([line(header), *(line(cells) for cells in body), "", *legend])
