import json

import numpy as np
import pytest

from shared.labels import CLASS_NAMES, CLASSES, N_CLASSES, class_index
from site_agent.data.label_maps import default_label_map, label_map_from_mapping, multi_hot, read_label_map


def test_the_twenty_fedcvd_classes_in_order() -> None:
    assert N_CLASSES == 20
    assert CLASS_NAMES == (
        "NORM", "STACH", "SBRAD", "SARRH", "PAC", "AFIB", "AFLT", "SVTAC", "PVC", "1AVB",
        "2AVB", "3AVB", "LBBB", "RBBB", "LAO/LAE", "LVH", "RVH", "AMI", "IMI", "ASMI",
    )  # fmt: skip
    assert [c.index for c in CLASSES] == list(range(20))


def test_class_index_is_case_insensitive_and_rejects_unknown_names() -> None:
    assert class_index("afib") == 5
    assert class_index(" lao/lae ") == 14
    with pytest.raises(ValueError, match="unknown ECG class 'STEMI'"):
        class_index("STEMI")


def test_snomed_map_merges_the_spec_codes() -> None:
    snomed = default_label_map("snomed")
    assert snomed.classes_of(["164889003"]) == ((5,), ())
    for code in ("54016002", "28189009", "164903001", "195042002", "284941000119107"):
        assert snomed.codes[code] == (10,)
    for code in ("445118002", "445211001", "164909002"):
        assert snomed.codes[code] == (12,)
    for code in ("713426002", "59118001", "164907000"):
        assert snomed.codes[code] == (13,)
    assert len(snomed.codes) == 28  # 10 single-code classes + 5 + 1 + 3 + 3 + 6


def test_ptbxl_map_merges_23_scp_codes_into_20_classes() -> None:
    ptbxl = default_label_map("ptbxl")
    assert len(ptbxl.codes) == 23
    assert ptbxl.classes_of(["CLBBB", "LAFB", "LPFB", "IRBBB", "CRBBB"]) == ((12, 13), ())
    assert ptbxl.classes_of(["NORM", "SR"]) == ((0,), ("SR",))


def test_aha_map_has_no_first_degree_av_block() -> None:
    aha = default_label_map("aha")
    assert aha.classes_of(["1", "82", "21"]) == ((0, 1), ("82",))
    assert 9 not in {i for indices in aha.codes.values() for i in indices}


def test_auto_map_accepts_names_scp_and_snomed_but_not_aha() -> None:
    auto = default_label_map("auto")
    assert auto.classes_of(["afib", "CRBBB", "7326005", "21"]) == ((5, 13, 18), ("21",))


def test_classes_of_reports_each_unmapped_code_once_and_skips_blanks() -> None:
    classes, unmapped = default_label_map("snomed").classes_of(["426783006", " ", "426783006", "164889003"])
    assert classes == (5,)
    assert unmapped == ("426783006",)


def test_encode_gives_a_multi_hot_float32_vector() -> None:
    vector = default_label_map("ptbxl").encode(["AFIB", "PVC", "unknown"])
    assert vector.dtype == np.float32 and vector.shape == (20,)
    assert np.flatnonzero(vector).tolist() == [5, 8]
    assert multi_hot([]).sum() == 0


def test_site_label_map_from_mapping_json_and_csv(tmp_path) -> None:
    inline = label_map_from_mapping({"X1": "afib", "X2": ["NORM", 8]})
    assert inline.classes_of(["x1", "X2"]) == ((0, 5, 8), ())
    json_file = tmp_path / "map.json"
    json_file.write_text(json.dumps({"A": "AFIB", "B": ["RBBB"]}))
    assert read_label_map(json_file).classes_of(["A", "B"]) == ((5, 13), ())
    csv_file = tmp_path / "map.csv"
    csv_file.write_text("code,class\nA,AFIB\nA,PVC\nB,NORM\n")
    assert read_label_map(csv_file).classes_of(["A"]) == ((5, 8), ())


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        ("[1, 2]", ".json", "expected a JSON object"),
        ("{not json", ".json", "not valid JSON"),
        ('{"A": "STEMI"}', ".json", "unknown ECG class"),
        ('{"A": []}', ".json", "maps to no class"),
        ('{"A": 25}', ".json", "out of range"),
        ("code,label\nA,AFIB\n", ".csv", "columns 'code' and 'class'"),
    ],
)
def test_bad_site_label_maps_are_refused_clearly(tmp_path, content: str, suffix: str, message: str) -> None:
    path = tmp_path / f"map{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_label_map(path)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown label scheme"):
        default_label_map("icd10")
