"""The survey of the real records in ../shared/data/ecg agrees with their manifest: rates, lengths, sex and age."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

from shared.wire.survey import GROUPS, SiteSurvey, age_key, duration_key, rate_key, sex_key
from shared.wire.survey_release import release
from site_agent.data import ChallengeSource, ManifestSource, PtbxlSource
from site_agent.data.survey import survey_site

pytestmark = pytest.mark.slow  # reads every real record: left out of `make test-fast`, as test_real_data.py


@pytest.fixture(scope="module")
def manifest_rows(real_ecg_dir: Path) -> list[dict[str, str]]:
    manifest = real_ecg_dir / "manifest.csv"
    if not manifest.is_file():
        pytest.skip(f"real ECG manifest not found at {manifest}")
    with manifest.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def manifest_survey(real_ecg_dir: Path, manifest_rows: list[dict[str, str]]) -> SiteSurvey:
    """All 1,021 records through the manifest, labelled by its SNOMED `dx` and PTB-XL `labels` columns."""
    return survey_site(ManifestSource(path=real_ecg_dir / "manifest.csv", label_column=("dx", "labels")))


def _over_groups(survey: SiteSurvey, table: str) -> Counter[str]:
    """A table's counts summed over the three groups, zeros left out."""
    total: Counter[str] = Counter()
    for group in GROUPS:
        total.update({key: int(value) for key, value in survey.groups[group].tables[table].items() if value})
    return total


def _expected(rows: list[dict[str, str]]) -> dict[str, Counter[str]]:
    """What the manifest says of these records, in the survey's keys."""
    return {
        "sampling_rate": Counter(rate_key(float(row["fs"])) for row in rows),
        "duration": Counter(duration_key(int(row["n_samples"]), float(row["fs"])) for row in rows),
        "sex": Counter(sex_key(row["sex"]) for row in rows),
        "age": Counter(age_key(row["age"]) for row in rows),
        "lead_set": Counter("12 standard" for row in rows if row["n_sig"] == "12"),
    }


def test_the_manifests_records_are_counted_as_it_describes_them(
    manifest_survey: SiteSurvey, manifest_rows: list[dict[str, str]]
) -> None:
    survey = manifest_survey
    assert sum(int(survey.groups[group].records) for group in GROUPS) == len(manifest_rows) == 1021
    # 136 Challenge records carry one of the 20 classes in `dx`, 39 PTB-XL records in `labels` (test_real_data.py)
    assert int(survey.groups["train"].records) + int(survey.groups["test"].records) == 175
    assert {k: v for k, v in survey.groups["excluded"].tables["reason"].items() if v} == {"no_label": 846}
    expected = _expected(manifest_rows)
    for table, counts in expected.items():
        assert _over_groups(survey, table) == counts, table
    assert _over_groups(survey, "sampling_rate") == {"400 Hz": 508, "500 Hz": 473, "100 Hz": 30, "1000 Hz": 10}
    assert expected["sex"]["unknown"] == 0 and expected["age"]["unknown"] == 3  # three Georgia headers say NaN
    quality = _over_groups(survey, "quality")
    assert "not_assessed" not in quality and "non_finite" not in quality  # every record reads, and finite
    assert quality["flat_lead"] == 6  # six Ningbo records carry a constant lead


def test_headers_give_the_same_demographics_as_the_manifest(
    real_ecg_dir: Path, manifest_rows: list[dict[str, str]]
) -> None:
    sources = [
        ChallengeSource(path=real_ecg_dir / "cinc2020_2021", name="cinc2020_2021"),
        PtbxlSource(path=real_ecg_dir / "ptbxl_subset", name="ptbxl_500hz"),
        PtbxlSource(path=real_ecg_dir / "ptbxl_subset", name="ptbxl_100hz", resolution="lr"),
    ]
    survey = survey_site(sources)
    rows = [row for row in manifest_rows if row["record"].startswith(("cinc2020_2021/", "ptbxl_subset/"))]
    assert sum(int(survey.groups[group].records) for group in GROUPS) == len(rows) == 313
    for table, counts in _expected(rows).items():
        assert _over_groups(survey, table) == counts, table
    assert (survey.groups["train"].records, survey.groups["test"].records) != (0, 0)


def test_the_real_survey_released_shows_nothing_small(manifest_survey: SiteSurvey) -> None:
    released = release(manifest_survey, min_records=20, noise_sigma=3.0, key=b"\x05" * 32)
    assert released.min_records == 20 and released.noise_sigma == 3.0
    assert all(value is None or value == 0 or value >= 20 for value in released.cells().values())
