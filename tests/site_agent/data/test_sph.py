"""SPH's AHA codes ('+' joins modifiers) and SPH's HDF5 records read as shipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from site_agent.data import ManifestSource, SourceError, SphSource, open_site_data, parse_source
from site_agent.data.config import PreprocessConfig
from site_agent.data.label_maps import default_label_map
from site_agent.data.scan import inspect_source
from site_agent.data.sources import split_codes

from .records import labels_by_record, make_record
from .sph_records import SphRow, sph_signal, write_sph


@pytest.mark.parametrize(
    ("text", "codes", "classes"),
    [
        ("22;50+346", ("22", "50", "346"), (2, 5)),  # SBRAD; AFIB with a modifier
        ("50+346", ("50", "346"), (5,)),
        ("21+330;60", ("21", "330", "60"), (1, 8)),
        (" 1 ; 23 + 500 ", ("1", "23", "500"), (0, 3)),
        ("346+347", ("346", "347"), ()),  # modifiers alone name no class
    ],
)
def test_aha_codes_split_on_plus_as_well_as_semicolon(text: str, codes: tuple[str, ...], classes: tuple) -> None:
    assert split_codes(text) == codes
    assert default_label_map("aha").classes_of(split_codes(text))[0] == classes


def test_manifest_of_aha_codes_keeps_the_statement_before_a_modifier(tmp_path: Path) -> None:
    for name in ("a", "b"):
        make_record(tmp_path / "wfdb", name, comments=())
    manifest = tmp_path / "sph.csv"
    manifest.write_text('record,labels\nwfdb/a,"22;50+346"\nwfdb/b,"60+330"\n')
    site = open_site_data(ManifestSource(path=manifest, label_scheme="aha", test_fraction=0.0), tmp_path / "cache")
    assert labels_by_record(site.train) == {"wfdb/a": [2, 5], "wfdb/b": [8]}
    assert site.report.sources[0].unmapped_codes == {"346": 1, "330": 1}


def test_sph_source_parses_by_kind(tmp_path: Path) -> None:
    source = parse_source({"kind": "sph", "path": str(tmp_path), "require_demographics": True})
    assert isinstance(source, SphSource) and source.require_demographics


def test_sph_records_load_with_their_classes_and_the_values_written(tmp_path: Path) -> None:
    long = sph_signal(12000, seed=7)  # SPH records run 10-60 s: the first 5000 samples are kept
    short = sph_signal(4000, seed=8)  # edge-padded, centred, the odd sample in front
    written = write_sph(
        tmp_path / "sph",
        [
            SphRow("A00001", "1"),
            SphRow("A00002", "22;50+346", signal=long),
            SphRow("A00003", "60+330", signal=short),
        ],
    )
    site = open_site_data(SphSource(path=tmp_path / "sph", test_fraction=0.0), tmp_path / "cache")
    assert labels_by_record(site.train) == {"A00001": [0], "A00002": [2, 5], "A00003": [8]}
    rows = {record_id.split("/", 1)[1]: i for i, record_id in enumerate(site.train.record_ids)}
    np.testing.assert_array_equal(site.train.signals[rows["A00001"]], written["A00001"])
    np.testing.assert_array_equal(site.train.signals[rows["A00002"]], long[:, :5000])
    padded = site.train.signals[rows["A00003"]]
    np.testing.assert_array_equal(padded[:, 500:4500], short)
    assert (padded[:, :500] == short[:, :1]).all() and (padded[:, 4500:] == short[:, -1:]).all()
    report = site.report.sources[0]
    assert (report.kind, report.loaded, report.truncated, report.padded) == ("sph", 3, 1, 1)
    assert report.sampling_rates == {"500 Hz": 3} and report.resampled == 0
    assert report.unmapped_codes == {"346": 1, "330": 1}


def test_bad_sph_records_are_skipped_and_counted_with_their_reason(tmp_path: Path) -> None:
    nan = sph_signal(5000, seed=1)
    nan[3, 100] = np.nan
    write_sph(
        tmp_path / "sph",
        [
            SphRow("A00001", "1"),
            SphRow("A00002", "1", file="garbage"),  # a corrupt HDF5 file
            SphRow("A00003", "1", file="other"),  # no dataset `ecg`
            SphRow("A00004", "1", file="none"),  # listed, but no file
            SphRow("A00005", "50", signal=nan),
            SphRow("A00006", "50", signal=sph_signal(5000).T.copy()),  # (N, 12)
            SphRow("A00007", "50", signal=sph_signal(5000)[:8]),  # 8 leads
            SphRow("A00008", "50", signal=np.zeros((12, 5000), np.float32)),
            SphRow("A00009", "999+346"),  # codes of no class
            SphRow("A00010", "21;23"),
        ],
    )
    report = inspect_source(SphSource(path=tmp_path / "sph", test_fraction=0.0), PreprocessConfig())
    assert report.candidates == 10 and report.loaded == 2
    assert report.skipped == {"unreadable": 5, "non_finite": 1, "all_zero": 1, "no_label": 1}
    assert report.examples["unreadable"] == ["A00002", "A00003", "A00004", "A00006", "A00007"]
    assert report.unmapped_codes == {"999": 1, "346": 1}
    assert report.label_counts[0] == 1 and report.label_counts[1] == 1 and report.label_counts[3] == 1


def test_sph_demographics_filter_counts_what_it_drops(tmp_path: Path) -> None:
    write_sph(
        tmp_path / "sph",
        [SphRow("A1", "1"), SphRow("A2", "1", age=""), SphRow("A3", "1", age="0"), SphRow("A4", "1", sex="")],
    )
    source = SphSource(path=tmp_path / "sph", require_demographics=True, test_fraction=0.0)
    site = open_site_data(source, tmp_path / "cache")
    assert list(labels_by_record(site.train)) == ["A1"]
    assert site.report.sources[0].skipped == {"bad_demographics": 3}


def test_sph_metadata_without_its_columns_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "sph").mkdir()
    with pytest.raises(SourceError, match="metadata.csv does not exist|No such file") as info:
        open_site_data(SphSource(path=tmp_path / "sph"), tmp_path / "cache")
    assert info.value.setting == "path"
    (tmp_path / "sph" / "metadata.csv").write_text("id,codes\nA1,1\n")
    with pytest.raises(SourceError, match="needs the columns ECG_ID and AHA_Code") as info:
        open_site_data(SphSource(path=tmp_path / "sph"), tmp_path / "cache")
    assert info.value.setting == "path"
