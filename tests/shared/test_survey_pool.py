"""Surveys pooled over sites: exact sums where nothing was hidden, lower bounds of shown counts otherwise."""

from __future__ import annotations

import pytest

from shared.evaluation.survey import HIDDEN, PooledCount, pool, survey_rows, survey_text
from shared.wire.survey import SiteSurvey
from shared.wire.survey_release import release, suppress
from tests.shared.survey_counts import random_survey, survey_with

MIN = 20


def test_a_pool_is_exact_or_a_lower_bound_of_what_was_shown() -> None:
    assert pool([30, 40]) == PooledCount(shown=70, hidden=0, counts=2) and pool([30, 40]).text() == "70"
    assert pool([30, None, 1200]).text() == "≥1,230" and not pool([30, None]).exact
    assert pool([None, None]).text() == HIDDEN and pool([0, None]).text() == HIDDEN  # "≥0" says nothing
    assert pool([0, 0]).text() == "0" and pool([]).text() == "0"


def _released(records: dict[str, int], **counts: int) -> SiteSurvey:
    return suppress(survey_with(records, **counts), MIN)


def test_the_pooled_table_never_holds_a_suppressed_count() -> None:
    small = _released({"train": 100, "test": 40, "excluded": 0}, train__labels__AFIB=5, train__labels__STACH=30)
    other = _released({"train": 100, "test": 40, "excluded": 0}, train__labels__AFIB=7, train__labels__STACH=30)
    large = _released({"train": 200, "test": 60, "excluded": 25}, train__labels__AFIB=50, train__labels__STACH=70)
    assert small == other  # 5 or 7 AFIB: the site sends the same report
    rows = {(row.table, row.key): row for row in survey_rows({"a": small.cells(), "b": large.cells()}, ["train"])}
    afib = rows[("labels", "AFIB")]
    assert [count.text() for count in afib.sites] == [HIDDEN, "50"] and afib.pooled.text() == "≥50"
    assert rows[("labels", "STACH")].pooled.text() == "100" and rows[("records", "records")].pooled.text() == "300"


@pytest.mark.parametrize("seed", range(12))
def test_every_pooled_figure_is_a_sum_of_shown_counts(seed: int) -> None:
    """Subtracting figures gives sums of shown counts only: each figure is one, exact only where nothing was hidden."""
    sites = {f"site{k}": release(random_survey(seed * 10 + k), min_records=MIN).cells() for k in range(3)}
    for groups in (["train"], ["test"], ["excluded"], ["train", "test", "excluded"]):
        for row in survey_rows(sites, groups):
            wanted = [(g, row.table, row.key) for g in groups if (g, row.table, row.key) in sites["site0"]]
            for report, count in zip(sites.values(), row.sites, strict=True):
                values = [report[cell] for cell in wanted]
                assert count.shown == sum(v for v in values if v is not None)
                assert count.hidden == values.count(None) and count.counts == len(values)
            assert row.pooled.shown == sum(count.shown for count in row.sites)
            assert row.pooled.hidden == sum(count.hidden for count in row.sites)
            assert row.pooled.exact == all(count.exact for count in row.sites)


def test_sites_of_another_vocabulary_or_no_sites_are_refused() -> None:
    cells = release(random_survey(1), min_records=MIN).cells()
    fewer = dict(list(cells.items())[:-1])
    with pytest.raises(ValueError, match="another survey version"):
        survey_rows({"a": cells, "b": fewer})
    with pytest.raises(ValueError, match="at least one site"):
        survey_rows({})
    with pytest.raises(ValueError, match="groups of a survey"):
        survey_rows({"a": cells}, ["validation"])


def test_the_text_table_has_a_column_per_site_and_the_marks_explained() -> None:
    a = _released({"train": 100, "test": 40, "excluded": 0}, train__labels__AFIB=5, train__labels__STACH=30)
    b = _released({"train": 200, "test": 60, "excluded": 25}, train__labels__AFIB=50, train__labels__STACH=70)
    text = survey_text({"hospital-a": a.cells(), "hospital-b": b.cells()}, groups=["train"], min_records=MIN)
    lines = text.splitlines()
    assert lines[0].split() == ["table", "key", "hospital-a", "hospital-b", "pooled"]
    assert lines[1].split() == ["records", "records", "100", "200", "300"]
    assert ["labels", "AFIB", HIDDEN, "50", "≥50"] in [line.split() for line in lines]
    assert ["labels", "STACH", "30", "70", "100"] in [line.split() for line in lines]
    assert f"fewer than {MIN} records" in text and "groups: train" in text and "noise" not in text
    noisy = survey_text({"a": a.cells()}, min_records=MIN, noise_sigma=25.5)
    assert "noise of sigma 25.5" in noisy and "groups: train, test, excluded" in noisy
