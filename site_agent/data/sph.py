"""Reading one SPH record as shipped: the HDF5 dataset `ecg`, (12, N) in mV at 500 Hz, leads in standard order."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from site_agent.data.records import STANDARD_LEADS, RecordSkipped
from site_agent.data.report import SkipReason

__all__ = ["SPH_DATASET", "SPH_FS", "read_sph_signal"]

SPH_DATASET = "ecg"
SPH_FS = 500.0  # every SPH record; the files carry no rate of their own


def _read(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as handle:
        dataset = handle.get(SPH_DATASET)
        if not isinstance(dataset, h5py.Dataset):
            raise RecordSkipped(SkipReason.UNREADABLE, f"no dataset {SPH_DATASET!r}")
        if dataset.ndim != 2 or dataset.shape[0] != len(STANDARD_LEADS):
            raise RecordSkipped(SkipReason.UNREADABLE, f"{SPH_DATASET!r} has shape {dataset.shape}, not (12, N)")
        if dataset.dtype.kind not in "fiu":
            raise RecordSkipped(SkipReason.UNREADABLE, f"{SPH_DATASET!r} holds {dataset.dtype}, not numbers")
        return np.asarray(dataset[()], dtype=np.float64)


def read_sph_signal(path: Path) -> np.ndarray:
    """The record's (12, N) float64 signal in mV, rows I, II, III, aVR, aVL, aVF, V1-V6 as stored."""
    try:
        return _read(path)
    except RecordSkipped:
        raise
    except Exception as exc:  # a missing or corrupt file must never stop the site: h5py raises many types
        raise RecordSkipped(SkipReason.UNREADABLE, f"{type(exc).__name__}: {exc}") from exc
