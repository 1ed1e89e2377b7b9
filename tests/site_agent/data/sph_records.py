"""Tiny SPH-like archives for the data tests: metadata.csv plus records/<ECG_ID>.h5 written with h5py."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

METADATA_COLUMNS = ("ECG_ID", "AHA_Code", "Patient_ID", "Age", "Sex", "N", "Date")


@dataclass(frozen=True)
class SphRow:
    """One record: its metadata and what its .h5 file holds."""

    ecg_id: str
    aha: str
    age: str = "50"
    sex: str = "M"
    signal: np.ndarray | None = None  # written as dataset `ecg`; None: a valid random record
    n_samples: int = 5000
    file: str = "ecg"  # "ecg": dataset `ecg`; "other": the data under another name; "garbage": not HDF5; "none"


def sph_signal(n_samples: int = 5000, seed: int = 0) -> np.ndarray:
    """(12, n) float32 in mV, neither zero nor constant."""
    rng = np.random.default_rng(seed)
    t = np.arange(n_samples) / 500.0
    return (np.sin(2 * np.pi * 1.2 * t)[None, :] * rng.uniform(0.5, 1.5, (12, 1))).astype(np.float32) + rng.normal(
        0, 0.02, (12, n_samples)
    ).astype(np.float32)


def write_sph(root: Path, rows: list[SphRow]) -> dict[str, np.ndarray]:
    """Write the archive under `root`; return each written `ecg` array by ECG_ID."""
    records = root / "records"
    records.mkdir(parents=True, exist_ok=True)
    written: dict[str, np.ndarray] = {}
    with (root / "metadata.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(METADATA_COLUMNS)
        for index, row in enumerate(rows):
            signal = row.signal if row.signal is not None else sph_signal(row.n_samples, seed=index)
            n = signal.shape[-1] if signal.ndim else 0
            writer.writerow([row.ecg_id, row.aha, f"P{index:05d}", row.age, row.sex, n, "2020-01-01"])
            path = records / f"{row.ecg_id}.h5"
            if row.file == "garbage":
                path.write_bytes(b"\x89HDF\r\n" + b"\x00" * 64)
            elif row.file in ("ecg", "other"):
                with h5py.File(path, "w") as h5:
                    h5.create_dataset("ecg" if row.file == "ecg" else "signal", data=signal)
                written[row.ecg_id] = signal
    return written


def write_fedcvd_split(folder: Path, train: list[str], test: list[str]) -> Path:
    """FedCVD's appendix/ECG/clientK layout; each row is 'ECG_ID,Code_Label,Age,Sex'."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        lines = ["ECG_ID,Code_Label,Age,Sex,Location", *(f"{row},client1" for row in rows)]
        (folder / f"{name}.csv").write_text("\n".join(lines) + "\n")
    return folder
