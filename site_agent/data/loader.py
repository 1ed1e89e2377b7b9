"""What the training loop uses: a site's train/test arrays from the cache, and fast batches over them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from site_agent.data.cache import build_or_open
from site_agent.data.config import DataSourceConfig, ManifestSource, PreprocessConfig
from site_agent.data.report import LoadReport, SkipReason, SourceReport
from site_agent.data.scan import check_source
from site_agent.data.sources import Source, SourceError
from site_agent.data.split import validation_rows

__all__ = [
    "RowView",
    "SiteData",
    "SplitArrays",
    "carve_validation",
    "iterate_batches",
    "open_site_data",
    "require_records",
]


class RowView:
    """Rows `rows` of `source`, read from it only when indexed: a subset of a memory map stays mapped."""

    def __init__(self, source: np.ndarray, rows: np.ndarray) -> None:
        self.source = source
        self.rows = rows  # indices into source's first axis, ascending so reads walk the file forward

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the rows would have as an array."""
        return (len(self.rows), *self.source.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        """The source's dtype."""
        return self.source.dtype

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: Any) -> Any:
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if isinstance(first, slice) and not rest:
            return RowView(self.source, self.rows[first])
        return self.source[(self.rows[first], *rest)]

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.source[self.rows], dtype=dtype)


@dataclass(frozen=True)
class SplitArrays:
    """One split of a site's data, memory-mapped from the cache."""

    signals: np.ndarray | RowView  # (N, 12, signal_len) float32 memmap, mV
    labels: np.ndarray  # (N, 20) float32 multi-hot
    record_ids: tuple[str, ...]  # "<source name>/<record id>" per row

    def __len__(self) -> int:
        return len(self.labels)

    def label_counts(self) -> npt.NDArray[np.int64]:
        """(20,) positives per class."""
        counts: npt.NDArray[np.int64] = self.labels.sum(axis=0).astype(np.int64)
        return counts

    def subset(self, rows: np.ndarray) -> SplitArrays:
        """The records at `rows` (ascending indices), their signals still read on demand."""
        if isinstance(self.signals, RowView):
            signals = RowView(self.signals.source, self.signals.rows[rows])
        else:
            signals = RowView(self.signals, rows)
        return SplitArrays(signals, np.asarray(self.labels[rows]), tuple(self.record_ids[row] for row in rows))


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
    _check_sources(source_list)
    config = PreprocessConfig(fs=fs, signal_len=signal_len, require_demographics=require_demographics)
    splits, report, folder = build_or_open(source_list, config, Path(cache_dir))
    arrays = {name: SplitArrays(s.signals, s.labels, s.record_ids) for name, s in splits.items()}
    return SiteData(train=arrays["train"], test=arrays["test"], report=report, cache_path=folder)


def carve_validation(split: SplitArrays, *, seed: int, fraction: float) -> tuple[SplitArrays, SplitArrays]:
    """(the records left to train on, the validation records): a seeded share `fraction` of `split`, disjoint."""
    held_out = validation_rows(split.record_ids, seed=seed, fraction=fraction)
    kept = np.setdiff1d(np.arange(len(split)), held_out, assume_unique=True)
    return split.subset(kept), split.subset(held_out)


def _check_sources(sources: Sequence[Source]) -> None:
    """Open every source's path, label map and split file before any record is read; names must be unique.

    The first problem raises SourceError naming the source and its setting at fault.
    """
    names: set[str] = set()
    for source in sources:
        if source.display_name in names:
            message = f"source names must be unique (set `name` to tell them apart): {source.display_name!r} twice"
            raise SourceError(source, "name", message)
        names.add(source.display_name)
        check_source(source)


def require_records(sources: Sequence[Source], report: LoadReport) -> None:
    """A source that loaded no record raises SourceError, naming the setting most likely at fault."""
    for source, counts in zip(sources, report.sources, strict=True):
        if counts.loaded == 0:
            raise SourceError(source, _empty_setting(source, counts), _empty_message(source, counts))


def _empty_setting(source: Source, counts: SourceReport) -> str:
    """`path` when records could not be read; the label settings when none carried a known class; the split's."""
    reasons = counts.skipped
    top = max(reasons, key=lambda reason: reasons[reason]) if reasons else None
    if top in (SkipReason.SPLIT_MISMATCH, SkipReason.NOT_IN_SPLIT_FILE):
        return "fedcvd_split" if source.fedcvd_split is not None else "split_file"
    if top != SkipReason.NO_LABEL:
        return "path"
    if source.label_map is None and isinstance(source, ManifestSource):
        return "label_column"
    return "label_map"


def _empty_message(source: Source, counts: SourceReport) -> str:
    """One line: how many records were found and why each was skipped, with the codes that mapped to nothing."""
    message = f"{source.path}: none of its {counts.candidates} records can be used (skipped: {counts.skip_summary()})"
    if isinstance(source, ManifestSource):
        message += f"; labels read from column(s) {', '.join(source.label_columns)}"
    if counts.unmapped_codes:
        message += f"; codes of no class: {counts.top_unmapped(5)}"
    return message


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
