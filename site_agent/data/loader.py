"""What the training loop uses: a site's train/test arrays from the cache, and fast batches over them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from site_agent.data.cache import build_or_open
from site_agent.data.config import DataSourceConfig, PreprocessConfig
from site_agent.data.report import LoadReport

__all__ = ["SiteData", "SplitArrays", "iterate_batches", "open_site_data"]


@dataclass(frozen=True)
class SplitArrays:
    """One split of a site's data, memory-mapped from the cache."""

    signals: np.ndarray  # (N, 12, signal_len) float32 memmap, mV
    labels: np.ndarray  # (N, 20) float32 multi-hot
    record_ids: tuple[str, ...]  # "<source name>/<record id>" per row

    def __len__(self) -> int:
        return len(self.labels)

    def label_counts(self) -> np.ndarray:
        """(20,) positives per class."""
        return self.labels.sum(axis=0).astype(np.int64)


@dataclass(frozen=True)
class SiteData:
    """A site's preprocessed data: train and test splits and how loading went."""

    train: SplitArrays
    test: SplitArrays
    report: LoadReport
    cache_path: Path  # the cache folder these arrays are mapped from


def open_site_data(
    sources: Sequence[DataSourceConfig] | DataSourceConfig,
    cache_dir: Path,
    *,
    signal_len: int = 5000,
    fs: int = 500,
    require_demographics: bool = False,
) -> SiteData:
    """Preprocess `sources` into the cache under `cache_dir` (once per content and settings) and map it."""
    source_list = list(sources) if isinstance(sources, Sequence) else [sources]
    if not source_list:
        raise ValueError("open_site_data needs at least one source")
    names = [s.display_name for s in source_list]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique (set `name` to tell them apart): {names}")
    config = PreprocessConfig(fs=fs, signal_len=signal_len, require_demographics=require_demographics)
    splits, report, folder = build_or_open(source_list, config, Path(cache_dir))
    arrays = {name: SplitArrays(s.signals, s.labels, s.record_ids) for name, s in splits.items()}
    return SiteData(train=arrays["train"], test=arrays["test"], report=report, cache_path=folder)


def iterate_batches(
    split: SplitArrays,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
    limit_samples: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield float32 (B, 12, L) signals and (B, 20) labels; one fancy-indexed read of the memmap per batch.

    With `shuffle`, the order is `torch.randperm(generator=generator)`, and each batch's indices are
    sorted so the read walks the file forward. `limit_samples` stops after that many samples.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(split)
    order = torch.randperm(n, generator=generator).numpy() if shuffle else np.arange(n)
    if limit_samples is not None:
        order = order[: max(limit_samples, 0)]
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        if drop_last and len(index) < batch_size:
            return
        if shuffle:
            index = np.sort(index)
        signals = np.asarray(split.signals[index], dtype=np.float32)
        labels = np.asarray(split.labels[index], dtype=np.float32)
        yield torch.from_numpy(signals), torch.from_numpy(labels)
