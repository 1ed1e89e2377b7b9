"""A site's survey finds and counts exactly what was planted in its records, and places them as its loader does."""

from __future__ import annotations

import csv
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.labels import CLASS_NAMES, CLASSES, class_index
from shared.wire.survey import GROUPS, QUALITY_FLAGS, REASON_KEYS, SiteSurvey, all_cells
from shared.wire.survey_release import release
from site_agent.data import ChallengeSource, SkipReason, SphSource
from site_agent.data.config import PreprocessConfig
from site_agent.data.quality import quality_flags
from site_agent.data.records import STANDARD_LEADS
from site_agent.data.scan import inspect_source
from site_agent.data.survey import RecordFacts, count_survey, lead_set_key, survey_records, survey_site
from site_agent.data.synthetic import write_record
from tests.site_agent.data.conftest import read_truth
from tests.site_agent.data.sph_records import SphRow, write_sph

SINUS = "426783006"  # maps to no class


def _code(name: str) -> str:
    return CLASSES[class_index(name)].codes["snomed"][0]


def _ecg(fs: int, seconds: float, seed: int) -> np.ndarray:
    """(12, samples) int16 in uV: per lead a 1.2 Hz wave of 0.5-1.5 mV plus 20 uV of noise, clean by every flag."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(fs * seconds)) / fs
    wave = 1000 * np.sin(2 * np.pi * 1.2 * t)[None, :] * rng.uniform(0.5, 1.5, (12, 1))
    return (wave + rng.normal(0, 20, (12, t.size))).astype(np.int16)


def _write(folder: Path, name: str, labels: list[str], age: str, sex: str, plant: dict[str, Any]) -> None:
    """One Challenge record of `labels`, with its defect planted (`plant`: fs, seconds, flat, clip, nan, ...)."""
    fs, seconds = int(plant.get("fs", 500)), float(plant.get("seconds", 10))
    digital = _ecg(fs, seconds, seed=sum(map(ord, name)))
    leads = list(STANDARD_LEADS)
    if plant.get("flat"):
        digital[8] = 0  # V3 disconnected
    if plant.get("clip"):
        digital = np.clip(digital, -300, 300)
    if plant.get("nan"):
        digital[3, 100:400] = -32768  # WFDB's "no sample": NaN when read
    if plant.get("zero"):
        digital[:] = 0
    if plant.get("spike"):
        digital[1, 2000] = 15000  # 15 mV
    if plant.get("wander"):
        digital = digital + (1000 * np.sin(2 * np.pi * 0.2 * np.arange(digital.shape[1]) / fs)).astype(np.int16)
    if plant.get("missing_lead"):
        digital, leads = digital[:-1], leads[:-1]
    if plant.get("extra_channel"):
        digital, leads = np.vstack([digital, digital[:1]]), [*leads, "VX"]
    if plant.get("duplicate_lead"):
        leads[-1] = "V5"
    codes = [_code(label) for label in labels] or [SINUS]
    write_record(folder, name, digital, fs, leads, [f"Age: {age}", f"Sex: {sex}", f"Dx: {','.join(codes)}"])
    if plant.get("garbage_header"):
        (folder / f"{name}.hea").write_bytes(b"\x00\xffnot a header\n" * 3)
    if plant.get("truncated"):
        mat = folder / f"{name}.mat"
        mat.write_bytes(mat.read_bytes()[:200])


# name: (labels, age, sex, split or None for "not in the split file", defects)
PLANTED: dict[str, tuple[list[str], str, str, str | None, dict[str, Any]]] = {
    **{f"clean{k}": (["NORM"], "45", "Female", "train", {}) for k in range(10)},
    **{f"flat{k}": (["SBRAD"], "70", "Male", "train", {"flat": True}) for k in range(4)},
    "long": (["LBBB"], "50", "Male", "train", {"fs": 1000, "seconds": 30}),
    "extra": (["NORM"], "45", "Female", "train", {"extra_channel": True}),
    "short": (["NORM"], "45", "Female", "train", {"seconds": 6}),
    "multi": (["SBRAD", "1AVB"], "45", "Female", "train", {}),
    **{f"clip{k}": (["STACH"], "85", "Female", "test", {"clip": True}) for k in range(3)},
    "slow": (["1AVB"], "45", "Male", "test", {"fs": 250}),
    "drift": (["NORM"], "45", "Male", "test", {"wander": True}),
    "spike": (["NORM"], "45", "Male", "test", {"spike": True}),
    **{f"nan{k}": (["AFIB"], "30", "Male", "train", {"nan": True}) for k in range(2)},
    "zero": (["NORM"], "10", "Female", "train", {"zero": True}),
    "eleven": (["RBBB"], "NaN", "Unknown", "train", {"missing_lead": True}),
    "garbage": (["NORM"], "45", "Female", "train", {"garbage_header": True}),
    "nolabel": ([], "45", "Female", "train", {}),
    "unlisted": (["NORM"], "45", "Female", None, {}),
    "twice": (["NORM"], "45", "Female", "train", {"duplicate_lead": True}),
    "cut": (["NORM"], "45", "Female", "train", {"truncated": True}),
}


def write_planted(folder: Path) -> ChallengeSource:
    """The PLANTED records in Challenge layout under `folder`, with their split file, as one source."""
    records = folder / "records"
    records.mkdir()
    for name, (labels, age, sex, _, plant) in PLANTED.items():
        _write(records, name, labels, age, sex, plant)
    split_file = folder / "split.csv"
    with split_file.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["record", "split"])
        writer.writerows([name, split] for name, (_, _, _, split, _) in PLANTED.items() if split is not None)
    return ChallengeSource(path=records, name="planted", split_file=split_file)


@pytest.fixture(scope="module")
def planted_site(tmp_path_factory: pytest.TempPathFactory) -> ChallengeSource:
    return write_planted(tmp_path_factory.mktemp("planted"))


@pytest.fixture(scope="module")
def planted_survey(planted_site: ChallengeSource) -> SiteSurvey:
    return survey_site(planted_site)


def _shown(survey: SiteSurvey, group: str, table: str) -> dict[str, int]:
    """A table's non-zero counts."""
    return {key: int(value) for key, value in survey.groups[group].tables[table].items() if value != 0}


def test_the_survey_counts_every_planted_defect_exactly(planted_survey: SiteSurvey) -> None:
    survey = planted_survey
    assert {group: survey.groups[group].records for group in GROUPS} == {"train": 18, "test": 6, "excluded": 9}
    assert _shown(survey, "train", "labels") == {"NORM": 12, "SBRAD": 5, "LBBB": 1, "1AVB": 1}
    assert _shown(survey, "test", "labels") == {"STACH": 3, "1AVB": 1, "NORM": 2}
    assert _shown(survey, "excluded", "labels") == {"AFIB": 2, "NORM": 4, "RBBB": 1}  # the garbage header's: unknown
    assert _shown(survey, "train", "quality") == {"flat_lead": 4}
    assert _shown(survey, "test", "quality") == {"clipped": 3, "baseline_wander": 1, "amplitude_outlier": 1}
    assert _shown(survey, "excluded", "quality") == {"non_finite": 2, "flat_lead": 1, "not_assessed": 4}
    assert _shown(survey, "excluded", "reason") == {
        "non_finite": 2,
        "all_zero": 1,
        "missing_lead": 1,
        "unreadable": 2,
        "no_label": 1,
        "not_in_split_file": 1,
        "duplicate_lead": 1,
    }
    assert _shown(survey, "train", "sampling_rate") == {"500 Hz": 17, "1000 Hz": 1}
    assert _shown(survey, "test", "sampling_rate") == {"500 Hz": 5, "250 Hz": 1}
    assert _shown(survey, "excluded", "sampling_rate") == {"500 Hz": 8, "unknown": 1}
    assert _shown(survey, "train", "duration") == {"10s": 16, "20-60s": 1, "5-10s": 1}
    assert _shown(survey, "excluded", "duration") == {"10s": 8, "unknown": 1}
    assert _shown(survey, "train", "lead_set") == {"12 standard": 17, "12 standard + other": 1}
    assert _shown(survey, "excluded", "lead_set") == {
        "12 standard": 6,
        "missing standard": 1,
        "duplicate standard": 1,
        "unknown": 1,
    }
    assert _shown(survey, "train", "age") == {"40-59": 14, "60-79": 4}
    assert _shown(survey, "test", "age") == {"80+": 3, "40-59": 3}
    assert _shown(survey, "excluded", "age") == {"18-39": 2, "<18": 1, "unknown": 2, "40-59": 4}
    assert _shown(survey, "train", "sex") == {"F": 13, "M": 5}
    assert _shown(survey, "excluded", "sex") == {"M": 2, "F": 5, "unknown": 2}


def test_a_class_missing_from_the_usable_records_is_found(planted_survey: SiteSurvey) -> None:
    survey = planted_survey
    usable = {
        name: sum(int(survey.groups[g].tables["labels"][name]) for g in ("train", "test")) for name in CLASS_NAMES
    }
    missing = sorted(name for name, count in usable.items() if count == 0)
    assert "AFIB" in missing and "3AVB" in missing  # AFIB's only records have NaN samples: all excluded
    assert survey.groups["excluded"].tables["labels"]["AFIB"] == 2


def test_the_survey_places_records_as_the_loader_does(
    planted_site: ChallengeSource, planted_survey: SiteSurvey
) -> None:
    survey = planted_survey
    report = inspect_source(planted_site, PreprocessConfig())
    assert (survey.groups["train"].records, survey.groups["test"].records) == (report.train, report.test)
    assert {k: v for k, v in survey.groups["excluded"].tables["reason"].items() if v} == report.skipped
    kept = [
        int(survey.groups["train"].tables["labels"][n]) + int(survey.groups["test"].tables["labels"][n])
        for n in CLASS_NAMES
    ]
    assert kept == report.label_counts


def test_the_generated_sites_skips_are_the_surveys_reasons(synthetic_sites: list[Path]) -> None:
    for site in synthetic_sites:
        survey = survey_site(ChallengeSource(path=site))
        expected = Counter(row["expected_skip"] for row in read_truth(site) if row["expected_skip"])
        assert {k: v for k, v in survey.groups["excluded"].tables["reason"].items() if v} == dict(expected)
        records = sum(int(survey.groups[group].records) for group in GROUPS)
        assert records == len(read_truth(site))
        assert survey.groups["excluded"].tables["quality"]["non_finite"] == expected[SkipReason.NON_FINITE.value]


def test_what_leaves_the_site_shows_no_small_count(planted_survey: SiteSurvey) -> None:
    released = release(planted_survey, min_records=5)
    cells = released.cells()
    assert cells[("train", "records", "records")] == 18 and cells[("test", "records", "records")] == 6
    assert cells[("train", "labels", "NORM")] == 12 and cells[("train", "labels", "SBRAD")] == 5
    assert cells[("train", "labels", "AFIB")] is None  # a patient table's 0
    assert cells[("train", "quality", "clipped")] == 0  # a recording table's 0
    assert cells[("test", "quality", "clipped")] is None  # 3 of 6
    assert all(value is None or value == 0 or value >= 5 for value in cells.values())


def _vector(facts: list[RecordFacts]) -> np.ndarray:
    return np.array(list(count_survey(facts).cells().values()), dtype=np.float64)


def test_one_record_moves_the_count_vector_by_at_most_sqrt_32(planted_site: ChallengeSource) -> None:
    facts = list(survey_records(planted_site))
    base = _vector(facts)
    for index in range(len(facts)):  # removing any one record
        assert np.linalg.norm(base - _vector(facts[:index] + facts[index + 1 :])) <= math.sqrt(32)
    worst = RecordFacts(
        group="excluded",
        reason="no_label",
        classes=tuple(range(len(CLASS_NAMES))),
        fs=500.0,
        n_samples=5000,
        lead_set="12 standard",
        quality=frozenset({"flat_lead", "non_finite", "clipped", "amplitude_outlier", "baseline_wander"}),
        age="40-59",
        sex="F",
    )
    assert np.linalg.norm(_vector([*facts, worst]) - base) == pytest.approx(math.sqrt(32))
    assert len(base) == len(all_cells())


def test_the_vocabulary_names_the_loaders_reasons_and_the_quality_flags() -> None:
    assert tuple(reason.value for reason in SkipReason) == REASON_KEYS
    assert set(QUALITY_FLAGS) == {flag for record in PLANTED.values() for flag in _flags_of(record[4])} - {""}


def _flags_of(plant: dict[str, Any]) -> set[str]:
    """The quality flag each planted defect is for ("" for the others)."""
    names = {"flat": "flat_lead", "nan": "non_finite", "clip": "clipped", "spike": "amplitude_outlier"}
    return {names.get(defect, "baseline_wander" if defect == "wander" else "") for defect in plant}


def test_lead_sets_and_quality_flags_by_their_thresholds() -> None:
    assert lead_set_key(list(STANDARD_LEADS)) == "12 standard"
    assert lead_set_key([lead.upper() for lead in STANDARD_LEADS]) == "12 standard"  # AVR for aVR
    assert lead_set_key([*STANDARD_LEADS, "X"]) == "12 standard + other"
    assert lead_set_key(list(STANDARD_LEADS[:-1])) == "missing standard" == lead_set_key(None)
    assert lead_set_key([*STANDARD_LEADS[:-1], "v5"]) == "duplicate standard"
    clean = _ecg(500, 10, 0) / 1000.0
    assert quality_flags(clean, 500.0) == frozenset()
    flat = clean.copy()
    flat[4] = 0.3 + 0.009 * np.sign(np.sin(np.arange(5000)))  # 18 uV peak to peak
    assert quality_flags(flat, 500.0) == {"flat_lead"}
    plateau = clean.copy()
    top = plateau[0].max()
    plateau[0, 1000:1019] = top  # 38 ms at the maximum: not yet
    assert quality_flags(plateau, 500.0) == frozenset()
    plateau[0, 1000:1020] = top  # 40 ms
    assert quality_flags(plateau, 500.0) == {"clipped"}
    outlier = clean.copy()
    outlier[2, 10] = np.median(outlier[2]) + 10.5
    assert quality_flags(outlier, 500.0) == {"amplitude_outlier"}
    drift = clean + 0.69 * np.sin(2 * np.pi * 0.3 * np.arange(5000) / 500)  # mean square 0.238 mV^2: not yet
    assert quality_flags(drift, 500.0) == frozenset()
    drift = clean + 0.72 * np.sin(2 * np.pi * 0.3 * np.arange(5000) / 500)  # 0.259 mV^2
    assert quality_flags(drift, 500.0) == {"baseline_wander"}
    broken = clean.copy()
    broken[5, 7] = np.inf
    assert quality_flags(broken, 500.0) == {"non_finite"}


def test_an_sph_archive_is_surveyed_from_its_table_and_files(tmp_path: Path) -> None:
    write_sph(
        tmp_path,
        [
            SphRow("A00001", "1", age="66", sex="F"),
            SphRow("A00002", "50", age="17", sex="M", n_samples=7500),
            SphRow("A00003", "1", age="90", sex="F", file="garbage"),
        ],
    )
    survey = survey_site(SphSource(path=tmp_path, test_fraction=0.0))
    assert (survey.groups["train"].records, survey.groups["excluded"].records) == (2, 1)
    assert _shown(survey, "train", "labels") == {"NORM": 1, "AFIB": 1}
    assert _shown(survey, "train", "duration") == {"10s": 1, "10-20s": 1}
    assert _shown(survey, "train", "age") == {"60-79": 1, "<18": 1} and _shown(survey, "train", "sex") == {
        "F": 1,
        "M": 1,
    }
    assert _shown(survey, "train", "lead_set") == {"12 standard": 2} and _shown(survey, "train", "quality") == {}
    unreadable = {
        table: _shown(survey, "excluded", table) for table in ("sampling_rate", "duration", "lead_set", "quality")
    }
    assert unreadable == {  # every SPH record is at 500 Hz; the rest of a corrupt file is unknown
        "sampling_rate": {"500 Hz": 1},
        "duration": {"unknown": 1},
        "lead_set": {"unknown": 1},
        "quality": {"not_assessed": 1},
    }
    assert _shown(survey, "excluded", "age") == {"80+": 1} and _shown(survey, "excluded", "labels") == {"NORM": 1}
