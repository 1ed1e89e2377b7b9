import numpy as np
import pytest

from site_agent.data.records import STANDARD_LEADS, RecordSkipped, header_fields, lead_order, read_header, read_signal
from site_agent.data.report import SkipReason

from .records import make_record


def test_lead_names_match_case_insensitively_and_are_reordered() -> None:
    names = ["v6", "AVR", "I", "II", "III", "avl", "aVF", "V1", "V2", "V3", "V4", "V5"]
    order = lead_order(names)
    assert [names[i].upper() for i in order] == [lead.upper() for lead in STANDARD_LEADS]


def test_extra_channels_are_ignored() -> None:
    assert lead_order(["vx", *STANDARD_LEADS, "vz"]) == list(range(1, 13))


def test_a_missing_lead_is_named() -> None:
    with pytest.raises(RecordSkipped) as info:
        lead_order(list(STANDARD_LEADS[:-1]))
    assert info.value.reason is SkipReason.MISSING_LEAD and info.value.detail == "V6"


def test_a_duplicated_lead_is_refused() -> None:
    with pytest.raises(RecordSkipped) as info:
        lead_order([*STANDARD_LEADS, "avr"])
    assert info.value.reason is SkipReason.DUPLICATE_LEAD


def test_header_fields_read_challenge_and_ptbxl_comment_styles() -> None:
    fields = header_fields(["Age: 63", "Sex: Male", "Dx: 1,2", "Labels: NORM, PAC", "no colon here", "Dx: later"])
    assert fields == {"age": "63", "sex": "Male", "dx": "1,2", "labels": "NORM, PAC"}


def test_read_signal_reorders_leads_and_gives_millivolts(tmp_path) -> None:
    shuffled = [STANDARD_LEADS[i] for i in (11, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)]
    digital = make_record(tmp_path, "r1", leads=shuffled)
    signal = read_signal(tmp_path / "r1", read_header(tmp_path / "r1"))
    assert signal.shape == (12, 5000)
    np.testing.assert_allclose(signal[11], digital[0] / 1000.0)  # V6 was written first
    np.testing.assert_allclose(signal[0], digital[1] / 1000.0)


def test_microvolt_records_are_converted_and_unknown_units_skipped(tmp_path) -> None:
    digital = make_record(tmp_path, "uv")
    header = tmp_path / "uv.hea"
    header.write_text(header.read_text().replace("/mV", "/uV"))
    signal = read_signal(tmp_path / "uv", read_header(tmp_path / "uv"))
    np.testing.assert_allclose(signal[0], digital[0] / 1e6)
    header.write_text(header.read_text().replace("/uV", "/mmHg"))
    with pytest.raises(RecordSkipped) as info:
        read_signal(tmp_path / "uv", read_header(tmp_path / "uv"))
    assert info.value.reason is SkipReason.UNKNOWN_UNITS


def test_unreadable_files_raise_unreadable(tmp_path) -> None:
    with pytest.raises(RecordSkipped) as info:
        read_header(tmp_path / "absent")
    assert info.value.reason is SkipReason.UNREADABLE
    make_record(tmp_path, "r2")
    (tmp_path / "r2.mat").write_bytes(b"\x00" * 100)
    with pytest.raises(RecordSkipped) as info:
        read_signal(tmp_path / "r2", read_header(tmp_path / "r2"))
    assert info.value.reason is SkipReason.UNREADABLE
