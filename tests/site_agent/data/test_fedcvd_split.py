"""FedCVD's record set and split: the age/sex filter from an experiment TOML, the shipped split keyed by ECG_ID."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cardiofl.experiment.config import load_experiment
from cardiofl.experiment.runner import load_sites
from site_agent.data import ChallengeSource, SourceError, SphSource, open_site_data

from .records import labels_by_record, make_record
from .sph_records import SphRow, sph_signal, write_fedcvd_split, write_sph


def nan_signal():
    signal = sph_signal(5000, seed=3)
    signal[0, 0] = float("nan")
    return signal


# FedCVD numbers the records it keeps: A1 -> 000000, A4 -> 000001, A7 -> 000002, A8 -> 000003.
SPH_ROWS = [
    SphRow("A1", "1", age="40", sex="M"),
    SphRow("A2", "999"),  # no class
    SphRow("A3", "22;50+346", age="130"),  # FedCVD keeps 0 < age < 120
    SphRow("A4", "22;50+346", age="60", sex="F"),
    SphRow("A5", "21", sex=""),  # no sex
    SphRow("A6", "30", signal=nan_signal()),  # dropped by FedCVD's NaN check
    SphRow("A7", "60", age="70", sex="M"),
    SphRow("A8", "1", age="33", sex="F"),
]


def write_toml(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_experiment_toml_require_demographics_drops_records_without_age_or_sex(tmp_path: Path) -> None:
    write_sph(tmp_path / "sph", SPH_ROWS)
    toml = write_toml(
        tmp_path / "exp.toml",
        f"""
name = "fedcvd-records"
cache_dir = "{tmp_path / "cache"}"

[[sites]]
name = "sph"
data = [{{ kind = "sph", path = "{tmp_path / "sph"}", require_demographics = true, test_fraction = 0.0 }}]
""",
    )
    config = load_experiment(toml)
    assert config.sites[0].data[0].require_demographics
    report = load_sites(config)["sph"].report.sources[0]
    assert report.skipped == {"bad_demographics": 2, "no_label": 1, "non_finite": 1}
    assert report.examples["bad_demographics"] == ["A3", "A5"]
    assert report.loaded == 4


def test_without_the_filter_records_lacking_age_or_sex_are_kept(tmp_path: Path) -> None:
    write_sph(tmp_path / "sph", SPH_ROWS)
    site = open_site_data(SphSource(path=tmp_path / "sph", test_fraction=0.0), tmp_path / "cache")
    assert sorted(labels_by_record(site.train)) == ["A1", "A3", "A4", "A5", "A7", "A8"]


def test_fedcvd_split_assigns_exactly_its_records_and_reports_unknown_ids(tmp_path: Path) -> None:
    write_sph(tmp_path / "sph", SPH_ROWS)
    split = write_fedcvd_split(
        tmp_path / "client1",
        train=["000000,0,40,M", "000002,8,70,M"],
        test=["000001,2;5,60,F", "000003,0,33,F", "000004,0,20,M"],  # 000004: FedCVD kept a record we lack
    )
    source = SphSource(path=tmp_path / "sph", fedcvd_split=split, require_demographics=True)
    site = open_site_data(source, tmp_path / "cache")
    assert labels_by_record(site.train) == {"A1": [0], "A7": [8]}
    assert labels_by_record(site.test) == {"A4": [2, 5], "A8": [0]}
    report = site.report.sources[0]
    assert report.skipped == {"bad_demographics": 2, "no_label": 1, "non_finite": 1}
    assert (report.split_unknown, report.split_unknown_examples) == (1, ["000004"])
    assert any("000004" in line for line in report.summary_lines())


def test_fedcvd_split_row_that_describes_another_record_is_a_mismatch(tmp_path: Path) -> None:
    write_sph(tmp_path / "sph", SPH_ROWS)
    split = write_fedcvd_split(
        tmp_path / "client1",
        train=["000000,0,40,M", "000002,4,70,M"],  # FedCVD's 000002 is a PAC, A7 a PVC
        test=["000001,2;5,61,F"],  # age differs
    )
    source = SphSource(path=tmp_path / "sph", fedcvd_split=split, require_demographics=True)
    site = open_site_data(source, tmp_path / "cache")
    assert labels_by_record(site.train, site.test) == {"A1": [0]}
    report = site.report.sources[0]
    assert report.skipped["split_mismatch"] == 2 and report.examples["split_mismatch"] == ["A4", "A7"]
    assert report.skipped["not_in_split_file"] == 1  # A8 got 000003, which the split does not list
    assert (report.split_unknown, report.split_unknown_examples) == (2, ["000001", "000002"])


def test_fedcvd_split_numbers_wfdb_records_in_sorted_folder_order(tmp_path: Path) -> None:
    root = tmp_path / "georgia"
    make_record(root / "g2", "E00003", comments=("Age: 61", "Sex: Female", "Dx: 164889003"))
    make_record(root / "g1", "E00002", comments=("Age: 50", "Sex: Unknown", "Dx: 164889003"))
    make_record(root / "g1", "E00001", comments=("Age: 45", "Sex: Male", "Dx: 426177001,59118001"))
    split = write_fedcvd_split(tmp_path / "client4", train=["000001,5,61,F"], test=["000000,13;2,45,M"])
    source = ChallengeSource(path=root, fedcvd_split=split, require_demographics=True)
    site = open_site_data(source, tmp_path / "cache")
    assert labels_by_record(site.train) == {"g2/E00003": [5]}
    assert labels_by_record(site.test) == {"g1/E00001": [2, 13]}
    assert site.report.sources[0].skipped == {"bad_demographics": 1}


def test_fedcvd_split_needs_the_demographics_filter_and_excludes_split_file(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="set require_demographics"):
        SphSource(path=tmp_path, fedcvd_split=tmp_path)
    with pytest.raises(ValidationError, match="split_file or fedcvd_split, not both"):
        SphSource(path=tmp_path, fedcvd_split=tmp_path, split_file=tmp_path / "s.csv", require_demographics=True)


def test_unreadable_fedcvd_split_names_its_setting(tmp_path: Path) -> None:
    write_sph(tmp_path / "sph", SPH_ROWS[:1])
    folder = tmp_path / "client1"
    source = SphSource(path=tmp_path / "sph", fedcvd_split=folder, require_demographics=True)
    with pytest.raises(SourceError, match="train.csv") as info:
        open_site_data(source, tmp_path / "cache")
    assert info.value.setting == "fedcvd_split"
    write_fedcvd_split(folder, train=["000000,0,40,M"], test=["000000,0,40,M"])
    with pytest.raises(SourceError, match="ECG_ID 000000 is listed twice"):
        open_site_data(source, tmp_path / "cache")


def test_record_split_file_reports_entries_that_name_no_record(tmp_path: Path) -> None:
    for name in ("r1", "r2"):
        make_record(tmp_path / "src", name)
    split_file = tmp_path / "split.csv"
    split_file.write_text("record,split\nr1,train\nr2,test\nghost,test\n")
    site = open_site_data(ChallengeSource(path=tmp_path / "src", split_file=split_file), tmp_path / "cache")
    assert list(labels_by_record(site.train)) == ["r1"] and list(labels_by_record(site.test)) == ["r2"]
    report = site.report.sources[0]
    assert (report.split_unknown, report.split_unknown_examples) == (1, ["ghost"])
