from pathlib import Path

import pytest

from shared.labels import class_index
from site_agent.data import ChallengeSource, ManifestSource, PtbxlSource, SourceError, open_site_data, parse_source

from .records import labels_by_record, make_record


def labels_of(site, split: str = "train") -> dict[str, list[int]]:
    return labels_by_record(getattr(site, split))


def test_source_configs_parse_by_kind(tmp_path) -> None:
    source = parse_source({"kind": "manifest", "path": str(tmp_path / "m.csv"), "label_scheme": "snomed"})
    assert isinstance(source, ManifestSource) and source.label_scheme == "snomed"
    assert isinstance(parse_source({"kind": "ptbxl", "path": "x"}), PtbxlSource)
    with pytest.raises(ValueError, match="kind"):
        parse_source({"kind": "edf", "path": "x"})
    with pytest.raises(ValueError, match="test_fraction"):
        parse_source({"kind": "challenge", "path": "x", "test_fraction": 1.5})


def test_manifest_maps_names_and_codes_and_uses_its_split_column(tmp_path) -> None:
    records = tmp_path / "archive" / "deep"
    for name in ("a", "b", "c", "d"):
        make_record(records, name, comments=())
    manifest = tmp_path / "archive" / "list.csv"
    manifest.write_text(
        "record,labels,split\n"
        "deep/a.hea,AFIB;crbbb,train\n"  # a class name and a PTB-XL code
        "deep/b,164884008,test\n"  # SNOMED PVC
        "deep/c,426783006,train\n"  # sinus rhythm: none of the 20 classes
        "deep/missing,NORM,train\n"
    )
    site = open_site_data(ManifestSource(path=manifest), tmp_path / "cache")
    assert labels_of(site, "train") == {"deep/a": [5, 13]}
    assert labels_of(site, "test") == {"deep/b": [8]}
    report = site.report.sources[0]
    assert report.candidates == 4 and report.loaded == 2
    assert report.skipped == {"no_label": 1, "unreadable": 1}
    assert report.examples["unreadable"] == ["deep/missing"]


def test_manifest_without_required_columns_is_refused(tmp_path) -> None:
    manifest = tmp_path / "list.csv"
    manifest.write_text("file,dx\nx,1\n")
    with pytest.raises(SourceError, match=r"no record column 'record' \(or 'path'\); its columns: 'file'") as info:
        open_site_data(ManifestSource(path=manifest), tmp_path / "cache")
    assert info.value.setting == "record_column"
    with pytest.raises(SourceError, match="no label column 'labels'") as info:
        open_site_data(ManifestSource(path=manifest, record_column="file"), tmp_path / "cache")
    assert info.value.setting == "label_column"


def test_missing_source_folder_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(SourceError, match="nowhere does not exist") as info:
        open_site_data(ChallengeSource(path=tmp_path / "nowhere"), tmp_path / "cache")
    assert info.value.setting == "path"


def write_coded_manifest(tmp_path: Path) -> Path:
    """Four records listed with SNOMED-CT codes in `dx`, class names or PTB-XL codes in `labels`, paths in `file`."""
    for name in ("a", "b", "c", "d"):
        make_record(tmp_path / "wfdb", name, comments=())
    manifest = tmp_path / "manifest.csv"
    manifest.write_text(
        "file,dx,labels,age\n"
        'wfdb/a,"164889003,59118001",,60\n'  # AFIB, RBBB
        "wfdb/b,426783006,NORM,70\n"  # sinus rhythm (no class); NORM by name
        "wfdb/c,,CRBBB,80\n"  # a PTB-XL code only
        "wfdb/d,426783006,,50\n"  # nothing FedCVD knows
    )
    return manifest


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, {"wfdb/b": [0], "wfdb/c": [13]}),  # today's default: the `labels` column, codes of any scheme
        ({"label_column": "dx"}, {"wfdb/a": [5, 13]}),
        ({"label_column": ["dx", "labels"]}, {"wfdb/a": [5, 13], "wfdb/b": [0], "wfdb/c": [13]}),
        # under a named scheme, class names still count; the other schemes' codes do not
        ({"label_column": ["dx", "labels"], "label_scheme": "snomed"}, {"wfdb/a": [5, 13], "wfdb/b": [0]}),
        ({"label_column": ["dx", "labels"], "label_scheme": "ptbxl"}, {"wfdb/b": [0], "wfdb/c": [13]}),
    ],
)
def test_manifest_label_columns_and_schemes(tmp_path: Path, options: dict, expected: dict) -> None:
    manifest = write_coded_manifest(tmp_path)
    source = parse_source({"kind": "manifest", "path": str(manifest), "record_column": "file", **options})
    site = open_site_data(source, tmp_path / "cache", signal_len=1000)
    assert labels_by_record(site.train, site.test) == expected
    report = site.report.sources[0]
    assert report.candidates == 4 and report.skipped == {"no_label": 4 - len(expected)}


def test_label_column_must_name_a_column(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="label_column"):
        parse_source({"kind": "manifest", "path": "m.csv", "label_column": []})
    assert parse_source({"kind": "manifest", "path": "m.csv", "label_column": ["dx"]}).label_columns == ("dx",)


def write_ptbxl(root, rows: list[tuple[int, str, str, str]]) -> None:
    """PTB-XL layout: records500/00000/NNNNN_hr + ptbxl_database.csv (ecg_id, age, sex, scp_codes, filenames)."""
    lines = ["ecg_id,patient_id,age,sex,scp_codes,filename_lr,filename_hr"]
    for ecg_id, age, sex, scp in rows:
        make_record(root / "records500" / "00000", f"{ecg_id:05d}_hr", comments=(), seed=ecg_id)
        hr, lr = f"records500/00000/{ecg_id:05d}_hr", f"records100/00000/{ecg_id:05d}_lr"
        lines.append(f'{ecg_id},{ecg_id + 100},{age},{sex},"{scp}",{lr},{hr}')
    (root / "ptbxl_database.csv").write_text("\n".join(lines) + "\n")


def test_ptbxl_database_gives_labels_regardless_of_likelihood(tmp_path) -> None:
    write_ptbxl(
        tmp_path / "ptbxl",
        [
            (1, "56.0", "1", "{'NORM': 100.0, 'SR': 0.0}"),
            (2, "300.0", "0", "{'IRBBB': 50.0, 'LAFB': 0.0, 'AFIB': 100.0}"),
            (3, "61.0", "0", "{'SR': 100.0}"),
            (4, "70.0", "0", "not a dict"),
        ],
    )
    site = open_site_data(PtbxlSource(path=tmp_path / "ptbxl", test_fraction=0.0), tmp_path / "cache")
    assert labels_of(site) == {"records500/00000/00001_hr": [0], "records500/00000/00002_hr": [5, 12, 13]}
    assert site.report.sources[0].skipped == {"no_label": 1, "unreadable": 1}
    assert site.report.sources[0].unmapped_codes == {"SR": 2}


def test_fedcvd_demographics_filter_drops_age_300(tmp_path) -> None:
    write_ptbxl(tmp_path / "ptbxl", [(1, "56.0", "1", "{'NORM': 100.0}"), (2, "300.0", "0", "{'AFIB': 100.0}")])
    source = PtbxlSource(path=tmp_path / "ptbxl", test_fraction=0.0)
    site = open_site_data(source, tmp_path / "cache", require_demographics=True)
    assert list(labels_of(site)) == ["records500/00000/00001_hr"]
    assert site.report.sources[0].skipped == {"bad_demographics": 1}


def test_ptbxl_without_database_reads_labels_from_the_header(tmp_path) -> None:
    root = tmp_path / "ptbxl"
    make_record(root / "records500" / "00000", "00005_hr", comments=("Age: 19", "Labels: NORM"))
    make_record(root / "records500" / "00000", "00006_hr", comments=("Labels: STTC, PVC",))
    make_record(root / "records500" / "00000", "00007_hr", comments=("Labels: Old MI, CD",))
    make_record(root / "records100" / "00000", "00005_lr", comments=("Labels: NORM",), fs=100, n_samples=1000)
    site = open_site_data(PtbxlSource(path=root, test_fraction=0.0), tmp_path / "cache")
    assert labels_of(site) == {"records500/00000/00005_hr": [0], "records500/00000/00006_hr": [8]}
    assert site.report.sources[0].skipped == {"no_label": 1}
    low = open_site_data(PtbxlSource(path=root, resolution="lr", test_fraction=0.0), tmp_path / "cache")
    assert list(labels_of(low)) == ["records100/00000/00005_lr"]
    assert low.report.sources[0].resampled == 1 and low.train.signals.shape == (1, 12, 5000)


def test_site_label_map_overrides_the_default(tmp_path) -> None:
    make_record(tmp_path / "src", "r1", comments=("Dx: 426783006",))
    make_record(tmp_path / "src", "r2", comments=("Dx: 164889003",))
    source = ChallengeSource(path=tmp_path / "src", test_fraction=0.0, label_map={"426783006": "NORM"})
    site = open_site_data(source, tmp_path / "cache")
    assert labels_of(site) == {"r1": [class_index("NORM")]}  # the default SNOMED map is replaced, not extended
    assert site.report.sources[0].skipped == {"no_label": 1}


def test_split_file_decides_the_split_and_unlisted_records_are_skipped(tmp_path) -> None:
    for name in ("r1", "r2", "r3"):
        make_record(tmp_path / "src" / "sub", name)
    split_file = tmp_path / "split.csv"
    split_file.write_text("record,split\nsub/r1,train\nr2.hea,test\n")
    site = open_site_data(ChallengeSource(path=tmp_path / "src", split_file=split_file), tmp_path / "cache")
    assert list(labels_of(site, "train")) == ["sub/r1"] and list(labels_of(site, "test")) == ["sub/r2"]
    assert site.report.sources[0].skipped == {"not_in_split_file": 1}
    split_file.write_text("record,split\nsub/r1,validation\n")
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        open_site_data(ChallengeSource(path=tmp_path / "src", split_file=split_file), tmp_path / "cache")


def test_seeded_split_is_about_80_20_and_stable(tmp_path) -> None:
    for i in range(30):
        make_record(tmp_path / "src", f"r{i:02d}", n_samples=500, seed=i)
    first = open_site_data(ChallengeSource(path=tmp_path / "src", seed=3), tmp_path / "c1", signal_len=500)
    again = open_site_data(ChallengeSource(path=tmp_path / "src", seed=3), tmp_path / "c2", signal_len=500)
    other = open_site_data(ChallengeSource(path=tmp_path / "src", seed=4), tmp_path / "c3", signal_len=500)
    assert first.test.record_ids == again.test.record_ids
    assert first.test.record_ids != other.test.record_ids
    assert 2 <= len(first.test) <= 12 and len(first.train) + len(first.test) == 30


def test_two_sources_need_distinct_names(tmp_path) -> None:
    make_record(tmp_path / "a" / "src", "r1")
    make_record(tmp_path / "b" / "src", "r1")
    a, b = tmp_path / "a" / "src", tmp_path / "b" / "src"
    with pytest.raises(ValueError, match="names must be unique"):
        open_site_data([ChallengeSource(path=a), ChallengeSource(path=b)], tmp_path / "c")
    site = open_site_data([ChallengeSource(path=a, name="A"), ChallengeSource(path=b, name="B")], tmp_path / "c")
    assert [s.name for s in site.report.sources] == ["A", "B"] and site.report.loaded == 2
