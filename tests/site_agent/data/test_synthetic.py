from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import wfdb
from scipy.signal import find_peaks

from shared.labels import CLASS_NAMES, class_index
from site_agent.data import ChallengeSource, open_site_data
from site_agent.data.label_maps import default_label_map
from site_agent.data.records import header_fields
from site_agent.data.synthetic import SiteProfile, default_site_profiles, generate_sites, sample_labels
from site_agent.data.synthetic_ecg import Artifacts, synthesize_ecg

from .conftest import N_RECORDS, read_truth
from .records import labels_by_record

FS = 500


def test_same_seed_writes_the_same_bytes(tmp_path) -> None:
    first = generate_sites(tmp_path / "a", 1, 6, seed=9, corrupt_fraction=0.5)[0]
    again = generate_sites(tmp_path / "b", 1, 6, seed=9, corrupt_fraction=0.5)[0]
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir()) and "truth.csv" in names
    assert all((first / n).read_bytes() == (again / n).read_bytes() for n in names)


def test_sites_differ_in_rate_and_records_read_back_with_wfdb(synthetic_sites: list[Path]) -> None:
    snomed = default_label_map("snomed")
    for site, fs in zip(synthetic_sites, (500, 250), strict=True):
        for row in read_truth(site):
            if row["corruption"]:
                continue
            record = wfdb.rdrecord(str(site / row["record"]))
            assert record.fs == fs and record.n_sig == 12 and record.p_signal.shape[1] == 12
            assert np.isfinite(record.p_signal).all()
            fields = header_fields(record.comments)
            assert fields["sex"] in ("Male", "Female") and 18 <= int(fields["age"]) <= 95
            classes, _ = snomed.classes_of(fields["dx"].split(","))
            assert ";".join(CLASS_NAMES[c] for c in classes) == row["labels"]


def test_loader_skips_exactly_the_broken_records_with_their_reasons(synthetic_sites, tmp_path) -> None:
    site = open_site_data([ChallengeSource(path=p) for p in synthetic_sites], tmp_path / "cache")
    for source, folder in zip(site.report.sources, synthetic_sites, strict=True):
        truth = read_truth(folder)
        expected = Counter(row["expected_skip"] for row in truth if row["expected_skip"])
        assert source.skipped == dict(expected)
        assert source.candidates == N_RECORDS and source.loaded == N_RECORDS - 8
        assert set(expected) == {"unreadable", "non_finite", "all_zero", "missing_lead", "no_label"}
    loaded = labels_by_record(site.train, site.test)
    for folder in synthetic_sites:
        for row in read_truth(folder):
            if not row["corruption"]:
                names = [CLASS_NAMES[c] for c in loaded[row["record"]]]
                assert ";".join(names) == row["labels"]
    assert site.report.sources[1].resampled == site.report.sources[1].loaded  # the 250 Hz site
    assert site.report.sources[0].resampled == 0
    assert sum(s.padded for s in site.report.sources) > 0


def test_default_profiles_are_non_iid() -> None:
    profiles = default_site_profiles(4, seed=0)
    assert [p.fs for p in profiles] == [500, 250, 1000, 500]
    assert [p.upper_case_leads for p in profiles] == [False, False, True, False]
    assert all(sum(1 for w in p.prior if w == 0) == 2 for p in profiles[1:])
    assert len({p.artifacts.gain for p in profiles}) == 4
    same = default_site_profiles(3, seed=0, heterogeneity=0.0)
    assert same[0].prior == same[1].prior == same[2].prior and same[0].artifacts == same[2].artifacts


def test_upper_case_leads_are_written_and_still_load(tmp_path) -> None:
    profile = SiteProfile(upper_case_leads=True, short_fraction=1.0)
    folder = generate_sites(tmp_path / "s", 1, 3, seed=1, profiles=[profile])[0]
    assert "AVR" in wfdb.rdheader(str(folder / "s00_00000")).sig_name
    site = open_site_data(ChallengeSource(path=folder, test_fraction=0.0), tmp_path / "cache")
    assert len(site.train) == 3 and site.report.sources[0].padded == 3


def test_label_sets_respect_priors_and_physiology() -> None:
    rng = np.random.default_rng(0)
    prior = np.ones(20)
    prior[class_index("RVH")] = 0.0
    sets = [sample_labels(prior, 0.9, rng) for _ in range(2000)]
    norm, afib = class_index("NORM"), class_index("AFIB")
    atrial = {class_index(n) for n in ("PAC", "1AVB", "2AVB", "3AVB", "LAO/LAE")}
    assert all(labels == {norm} for labels in sets if norm in labels)
    assert all(not (labels & atrial) for labels in sets if afib in labels)
    assert not any(class_index("RVH") in labels for labels in sets)
    assert sum(len(labels) > 1 for labels in sets) > 500


def features(signal: np.ndarray) -> dict[str, float]:
    """Heart rate, RR irregularity, earliest beat, QRS width and Sokolow-Lyon voltage, as a reader measures."""
    energy = np.convolve(np.sum(np.diff(signal, axis=1) ** 2, axis=0), np.ones(10) / 10, mode="same")
    peaks, _ = find_peaks(energy, height=0.25 * np.percentile(energy, 99.5), distance=int(0.2 * FS))
    rr = np.diff(peaks) / FS
    widths = [np.sum(energy[max(p - 60, 0) : p + 60] > 0.1 * energy[p]) / FS for p in peaks]
    return {
        "bpm": 60.0 / float(np.median(rr)),
        "rr_cv": float(rr.std() / rr.mean()),
        "earliest": float(rr.min() / np.median(rr)),
        "qrs_s": float(np.median(widths)),
        "sokolow_mv": float(signal[10].max() - signal[6].min()),  # R in V5 + S in V1
    }


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict[str, float]]]:
    rng = np.random.default_rng(0)
    artifacts = Artifacts(noise_mv=0.01, wander_mv=0.1)
    names = ("NORM", "STACH", "SBRAD", "SVTAC", "AFIB", "PVC", "LBBB", "RBBB", "LVH")
    return {n: [features(synthesize_ecg({class_index(n)}, FS, 10.0, rng, artifacts)) for _ in range(10)] for n in names}


def values(measured, name: str, key: str) -> np.ndarray:
    return np.array([m[key] for m in measured[name]])


def test_rate_labels_are_visible_in_the_rr_intervals(measured) -> None:
    assert np.all((values(measured, "NORM", "bpm") > 58) & (values(measured, "NORM", "bpm") < 102))
    assert np.all((values(measured, "STACH", "bpm") > 100) & (values(measured, "STACH", "bpm") < 155))
    assert np.all(values(measured, "SBRAD", "bpm") < 60)
    assert np.all(values(measured, "SVTAC", "bpm") > 150)


def test_rhythm_labels_are_visible_in_the_rr_intervals(measured) -> None:
    assert values(measured, "AFIB", "rr_cv").min() > 0.1 > 0.06 > values(measured, "NORM", "rr_cv").max()
    assert values(measured, "PVC", "earliest").max() < 0.8 < 0.85 < values(measured, "NORM", "earliest").min()


def test_conduction_and_hypertrophy_labels_are_visible_in_the_qrs(measured) -> None:
    normal_width = values(measured, "NORM", "qrs_s").max()
    assert values(measured, "LBBB", "qrs_s").min() > normal_width
    assert values(measured, "RBBB", "qrs_s").min() > normal_width
    assert values(measured, "LVH", "sokolow_mv").min() > values(measured, "NORM", "sokolow_mv").max()


def test_generator_refuses_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least one site"):
        generate_sites(tmp_path, 0, 5, seed=0)
    with pytest.raises(ValueError, match="corrupt_fraction"):
        generate_sites(tmp_path, 1, 5, seed=0, corrupt_fraction=2.0)
    with pytest.raises(ValueError, match="2 profiles for 1 sites"):
        generate_sites(tmp_path, 1, 5, seed=0, profiles=[SiteProfile(), SiteProfile()])
