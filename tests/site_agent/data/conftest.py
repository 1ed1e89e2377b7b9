"""Synthetic sites shared by the data tests, and the location of the real ECG records."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from site_agent.data.synthetic import TRUTH_FILE, generate_sites

ECG_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "ecg"
N_RECORDS = 40


@pytest.fixture(scope="session")
def synthetic_sites(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two sites (500 Hz and 250 Hz) of 40 records, 8 of them written broken on purpose. Read only."""
    return generate_sites(tmp_path_factory.mktemp("sites"), 2, N_RECORDS, seed=5, corrupt_fraction=0.2)


def read_truth(site: Path) -> list[dict[str, str]]:
    """The generator's record list: record, labels, corruption, expected_skip."""
    with (site / TRUTH_FILE).open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="session")
def real_ecg_dir() -> Path:
    """The real records next to the repository, or a skip."""
    if not (ECG_DIR / "cinc2020_2021").is_dir() or not (ECG_DIR / "ptbxl_subset").is_dir():
        pytest.skip(f"real ECG records not found at {ECG_DIR}")
    return ECG_DIR
