"""Every record of the real cinc2020_2021/ and ptbxl_subset/ folders goes through the real sources."""

from pathlib import Path

import numpy as np
import pytest
import torch

from shared.labels import class_index
from site_agent.data import (
    ChallengeSource,
    ManifestSource,
    PtbxlSource,
    SiteData,
    SkipReason,
    iterate_batches,
    open_site_data,
)
from site_agent.data.config import PreprocessConfig
from site_agent.data.scan import inspect_source


@pytest.fixture(scope="module")
def real_site(real_ecg_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SiteData:
    sources = [
        ChallengeSource(path=real_ecg_dir / "cinc2020_2021", name="cinc2020_2021"),
        PtbxlSource(path=real_ecg_dir / "ptbxl_subset", name="ptbxl_subset_500hz"),
        PtbxlSource(path=real_ecg_dir / "ptbxl_subset", name="ptbxl_subset_100hz", resolution="lr"),
    ]
    return open_site_data(sources, tmp_path_factory.mktemp("real-cache"))


def test_every_record_is_loaded_or_skipped_with_a_reason(real_site: SiteData, real_ecg_dir: Path) -> None:
    headers = {
        "cinc2020_2021": len(list((real_ecg_dir / "cinc2020_2021").rglob("*.hea"))),
        "ptbxl_subset_500hz": len(list((real_ecg_dir / "ptbxl_subset" / "records500").rglob("*.hea"))),
        "ptbxl_subset_100hz": len(list((real_ecg_dir / "ptbxl_subset" / "records100").rglob("*.hea"))),
    }
    known = {reason.value for reason in SkipReason}
    for source in real_site.report.sources:
        assert source.candidates == headers[source.name] > 0
        assert source.loaded + source.n_skipped == source.candidates
        assert source.train + source.test == source.loaded
        assert set(source.skipped) <= known


def test_per_source_counts(real_site: SiteData) -> None:
    by_name = {s.name: s for s in real_site.report.sources}
    cinc, hr, lr = by_name["cinc2020_2021"], by_name["ptbxl_subset_500hz"], by_name["ptbxl_subset_100hz"]
    # 136 of the 250 Challenge records carry one of the 20 FedCVD SNOMED codes (data README).
    assert (cinc.candidates, cinc.loaded, cinc.skipped) == (250, 136, {"no_label": 114})
    assert cinc.truncated == 14 and cinc.resampled == 1  # 10-115 s records; one 1000 Hz PTB record is labelled
    assert cinc.unmapped_codes["426783006"] == 73  # sinus rhythm maps to no FedCVD class, as in FedCVD
    # PTB-XL headers carry superclasses: only NORM, PAC and PVC name one of the 20 classes.
    assert (hr.candidates, hr.loaded, hr.skipped) == (33, 21, {"no_label": 12})
    assert (lr.candidates, lr.loaded, lr.skipped) == (30, 18, {"no_label": 12})
    assert lr.resampled == 18  # 100 Hz -> 500 Hz
    assert hr.label_counts[class_index("NORM")] == 19


def test_label_counts_are_sane(real_site: SiteData) -> None:
    for source in real_site.report.sources:
        assert sum(source.label_counts) >= source.loaded  # every loaded record has a class
        assert sum(source.label_counts) <= 3 * source.loaded
    cinc = real_site.report.sources[0].label_counts
    assert cinc[class_index("SBRAD")] > 0 and cinc[class_index("AFIB")] > 0 and cinc[class_index("RBBB")] > 0
    arrays = np.concatenate([real_site.train.labels, real_site.test.labels])
    assert arrays.sum(axis=0).tolist() == np.sum([s.label_counts for s in real_site.report.sources], axis=0).tolist()
    assert (arrays.sum(axis=1) >= 1).all()


def test_no_nan_reaches_a_tensor(real_site: SiteData) -> None:
    for split in (real_site.train, real_site.test):
        assert split.signals.shape[1:] == (12, 5000)
        for signals, labels in iterate_batches(split, 64, shuffle=False):
            assert torch.isfinite(signals).all() and torch.isfinite(labels).all()
            assert signals.abs().max() < 50.0  # millivolts
            assert (signals.abs().amax(dim=2) > 0).any(dim=1).all()  # no all-zero record


def test_the_real_manifest_loads_with_its_label_column_named(real_site: SiteData, real_ecg_dir: Path) -> None:
    manifest = real_ecg_dir / "manifest.csv"
    if not manifest.is_file():
        pytest.skip(f"real ECG manifest not found at {manifest}")
    by_column = {
        column: inspect_source(ManifestSource(path=manifest, label_column=column), PreprocessConfig())
        for column in ("labels", "dx", ("dx", "labels"))
    }
    # `labels` (the default) holds free text, Chagas flags and PTB-XL superclasses: 21 + 18 PTB-XL records.
    assert (by_column["labels"].candidates, by_column["labels"].loaded) == (1021, 39)
    # `dx` holds the Challenge records' SNOMED-CT codes: the same 136 records and classes as their headers give.
    dx, cinc = by_column["dx"], real_site.report.sources[0]
    assert (dx.candidates, dx.loaded, dx.skipped) == (1021, 136, {"no_label": 885})
    assert (dx.label_counts, dx.truncated, dx.resampled) == (cinc.label_counts, cinc.truncated, cinc.resampled)
    assert by_column[("dx", "labels")].loaded == 136 + 39
