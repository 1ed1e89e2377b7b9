"""A survey on the wire: fixed keys, strict counts, exact surveys that add up, released ones with nothing small."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from shared.labels import CLASS_NAMES
from shared.wire.survey import (
    AGE_KEYS,
    GROUPS,
    MAX_CONTRIBUTIONS,
    SUPPRESSED,
    SURVEY_L2_SENSITIVITY,
    TABLES,
    SiteSurvey,
    age_key,
    all_cells,
    duration_key,
    rate_key,
    sex_key,
    tables_of,
)
from shared.wire.survey_release import suppress
from tests.shared.survey_counts import random_survey, survey_with


def test_the_bins_give_each_value_its_key() -> None:
    assert [rate_key(fs) for fs in (500, 500.004, 499.9, 100.0, 257, 1000, 0, -5, None, math.nan)] == [
        "500 Hz",
        "500 Hz",
        "other",
        "100 Hz",
        "257 Hz",
        "1000 Hz",
        "unknown",
        "unknown",
        "unknown",
        "unknown",
    ]
    samples: list[tuple[int | None, float | None]] = [(5000, 500), (5001, 500), (4999, 500), (1000, 100)]
    samples += [(2934, 400), (4096, 400), (2000, 500)]
    samples += [(40000, 1000), (115200, 1000), (60000, 1000), (5000, None), (None, 500)]
    assert [duration_key(n, fs) for n, fs in samples] == [
        "10s",
        "10-20s",
        "5-10s",
        "10s",
        "5-10s",
        "10-20s",
        "<5s",
        "20-60s",
        ">60s",
        "20-60s",
        "unknown",
        "unknown",
    ]
    ages = ["0", "17.9", "18", "39", "40", "59.5", "60", "79", "80", "300", "NaN", "", None, "-1", "old", 45.0]
    assert [age_key(age) for age in ages] == [
        "<18",
        "<18",
        "18-39",
        "18-39",
        "40-59",
        "40-59",
        "60-79",
        "60-79",
        "80+",
        "80+",  # PTB-XL's "over 89"
        "unknown",
        "unknown",
        "unknown",
        "unknown",
        "unknown",
        "40-59",
    ]
    assert AGE_KEYS == ("<18", "18-39", "40-59", "60-79", "80+", "unknown")
    spellings = ["Female", "F", "f", "female ", "Male", "M", "m", "Unknown", "", None, "1", "other"]
    assert [sex_key(sex) for sex in spellings] == ["F"] * 4 + ["M"] * 3 + ["unknown"] * 5


def test_one_record_moves_at_most_32_counts_by_one() -> None:
    # records + 20 labels + 6 partitions (rate, duration, lead set, age, sex, reason) + 5 quality flags
    assert MAX_CONTRIBUTIONS == 1 + len(CLASS_NAMES) + 6 + 5 == 32
    assert SURVEY_L2_SENSITIVITY == pytest.approx(math.sqrt(32))
    quality = next(table for table in TABLES if table.name == "quality")
    assert quality.per_record == len(quality.keys) - 1  # "not_assessed" excludes the flags


def test_a_survey_has_exactly_its_groups_tables_and_keys() -> None:
    survey = random_survey(1)
    assert list(survey.cells()) == list(all_cells())
    assert [t.name for t in tables_of("train")] == [
        "labels",
        "sampling_rate",
        "duration",
        "lead_set",
        "quality",
        "age",
        "sex",
    ]
    assert [t.name for t in tables_of("excluded")][-1] == "reason"
    assert SiteSurvey.model_validate_json(survey.model_dump_json()) == survey
    data = json.loads(survey.model_dump_json())
    changes: list[Callable[[dict[str, Any]], object]] = [
        lambda d: d["groups"].pop("excluded"),
        lambda d: d["groups"]["train"]["tables"].pop("sex"),
        lambda d: d["groups"]["train"]["tables"]["sex"].pop("unknown"),
        lambda d: d["groups"]["train"]["tables"]["sex"].update(X=0),
        lambda d: d["groups"]["train"]["tables"].update(reason=d["groups"]["excluded"]["tables"]["reason"]),
        lambda d: d.update(extra=1),
        lambda d: d["groups"]["test"].update(records=True),
        lambda d: d["groups"]["test"].update(records=-1),
        lambda d: d["groups"]["test"].update(records=1.0),
        lambda d: d["groups"]["test"].update(records="< 20"),
        lambda d: d.update(version=2),
    ]
    for change in changes:
        broken = json.loads(json.dumps(data))
        change(broken)
        with pytest.raises(ValidationError):
            SiteSurvey.model_validate_json(json.dumps(broken))


def test_an_exact_survey_adds_up() -> None:
    survey = survey_with({"train": 50, "test": 30, "excluded": 5}, train__sex__M=20)
    data = json.loads(survey.model_dump_json())
    data["groups"]["train"]["tables"]["sex"]["M"] = 21  # the partition no longer sums to 50
    with pytest.raises(ValidationError, match="sum to 51, not 50"):
        SiteSurvey.model_validate(data)
    data = json.loads(survey.model_dump_json())
    data["groups"]["test"]["tables"]["labels"]["AFIB"] = 31
    with pytest.raises(ValidationError, match="above the group's 30 records"):
        SiteSurvey.model_validate(data)
    data = json.loads(survey.model_dump_json())
    data["groups"]["test"]["tables"]["labels"]["AFIB"] = SUPPRESSED
    with pytest.raises(ValidationError, match="suppresses nothing"):
        SiteSurvey.model_validate(data)


def test_a_released_survey_shows_nothing_small() -> None:
    base = suppress(survey_with({"train": 50, "test": 30, "excluded": 0}), 20)
    cells = base.cells()
    assert cells[("train", "sampling_rate", "250 Hz")] == 0 and cells[("excluded", "records", "records")] == 0
    assert SiteSurvey.from_cells(cells, min_records=20) == base
    for cell, value in (
        (("train", "labels", "AFIB"), 5),  # a small count
        (("train", "labels", "AFIB"), 0),  # a patient table's 0
        (("test", "records", "records"), 19),
        (("train", "sampling_rate", "250 Hz"), 1),
    ):
        with pytest.raises(ValidationError, match="below min_records 20"):
            SiteSurvey.from_cells({**cells, cell: value}, min_records=20)
    shown = {**cells, ("train", "sex", "unknown"): 0, ("train", "quality", "clipped"): 0}
    assert SiteSurvey.from_cells(shown, min_records=20).groups["train"].records == 50


@pytest.mark.parametrize("group", GROUPS)
def test_cells_and_back_are_the_same_survey(group: str) -> None:
    survey = random_survey(7)
    assert SiteSurvey.from_cells(survey.cells()) == survey
    assert survey.cells()[(group, "records", "records")] == survey.groups[group].records
