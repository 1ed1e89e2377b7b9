"""Small WFDB record writers for the data tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from site_agent.data import SplitArrays
from site_agent.data.records import STANDARD_LEADS
from site_agent.data.synthetic import write_record


def ecg_like(n_samples: int = 5000, seed: int = 0, n_leads: int = 12) -> np.ndarray:
    """(leads, T) int16 digital samples (1 uV per unit) that are neither zero nor constant."""
    rng = np.random.default_rng(seed)
    t = np.arange(n_samples) / 500.0
    base = 800 * np.sin(2 * np.pi * 1.2 * t)[None, :] * rng.uniform(0.5, 1.5, (n_leads, 1))
    return (base + rng.normal(0, 20, (n_leads, n_samples))).astype(np.int16)


def make_record(
    folder: Path,
    name: str,
    *,
    comments: Sequence[str] = ("Dx: 164889003",),
    leads: Sequence[str] = STANDARD_LEADS,
    fs: int = 500,
    n_samples: int = 5000,
    seed: int = 0,
) -> np.ndarray:
    """Write one Challenge-style record and return its digital samples in the order written."""
    folder.mkdir(parents=True, exist_ok=True)
    digital = ecg_like(n_samples, seed, len(leads))
    write_record(folder, name, digital, fs, list(leads), list(comments))
    return digital


def labels_by_record(*splits: SplitArrays) -> dict[str, list[int]]:
    """{record id without the source name: class indices} over the given splits."""
    return {
        record_id.split("/", 1)[1]: np.flatnonzero(row).tolist()
        for split in splits
        for record_id, row in zip(split.record_ids, split.labels, strict=True)
    }
