"""The on-disk cache of preprocessed records: keyed by source content and settings, built once, memory-mapped.

Layout of `cache_dir/<key>/`: `{train,test}_signals.f32` (raw float32, (N, 12, L) C order, written one
record at a time so a large archive never sits in memory), `{train,test}_labels.npy`, `meta.json`
(counts, record ids) and `report.json`. A build runs under a per-key file lock into a temporary folder
that is renamed into place when complete, so concurrent builders and crashes never leave a half cache.

The key hashes every source file's bytes. Digests are remembered in `file_digests.json` by (size,
mtime, inode), like git's index: a file rewritten with the same size that keeps its old mtime and
inode is taken as unchanged; files modified in the last two seconds are always re-read. When the
files change, the new cache replaces the old one of the same settings (it is deleted after the build).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from filelock import FileLock

from shared.errors import PluginIdentityError
from shared.labels import N_CLASSES
from site_agent.data.config import SOURCES, PreprocessConfig
from site_agent.data.label_maps import multi_hot
from site_agent.data.records import STANDARD_LEADS
from site_agent.data.report import LoadReport, SourceReport
from site_agent.data.scan import scan_source
from site_agent.data.sources import Source, SourceError, reading, source_files

__all__ = ["CACHE_VERSION", "CachedSplit", "build_or_open", "cache_key"]

CACHE_VERSION = 3  # bump when the layout, the preprocessing or the stored report changes meaning (3: '+' in codes)
SPLITS = ("train", "test")
DIGEST_MEMO = "file_digests.json"
_TRUST_AFTER_S = 2.0  # a file changed this recently may change again within the same mtime tick
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CachedSplit:
    """The arrays of one split as stored."""

    signals: np.ndarray  # (N, 12, L) float32 memmap (a plain empty array when N == 0)
    labels: np.ndarray  # (N, C) float32
    record_ids: tuple[str, ...]  # "<source name>/<record id>"


class _DigestMemo:
    """sha256 of each source file, remembered by (size, mtime, inode) so an unchanged archive is not re-read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.changed = False
        try:
            self.entries: dict[str, list[Any]] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def digest(self, file: Path) -> str:
        stat = file.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        key = str(file.resolve())
        entry = self.entries.get(key)
        if entry is not None and entry[:3] == stamp:
            return str(entry[3])
        hasher = hashlib.sha256()
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                hasher.update(chunk)
        digest = hasher.hexdigest()
        if time.time_ns() - stat.st_mtime_ns > _TRUST_AFTER_S * 1e9:
            self.entries[key] = [*stamp, digest]
            self.changed = True
        return digest

    def save(self) -> None:
        if self.changed:
            _atomic_write_text(self.path, json.dumps(self.entries))


def _atomic_write_text(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def cache_key(sources: list[Source], config: PreprocessConfig, cache_dir: Path) -> str:
    """sha256 over the cache version, the preprocessing settings, each source's settings and file contents."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    memo = _DigestMemo(cache_dir / DIGEST_MEMO)
    described = []
    for source in sources:
        root = source.path.resolve().parent if source.path.is_file() else source.path.resolve()
        files = []
        for file in source_files(source, exclude=cache_dir):
            name = file.resolve().relative_to(root).as_posix() if file.resolve().is_relative_to(root) else str(file)
            with reading(source, "path", file):
                files.append([name, memo.digest(file)])
        entry: dict[str, Any] = {"config": source.model_dump(mode="json"), "files": files}
        try:
            plugin = SOURCES.plugin(source.kind)
        except PluginIdentityError as exc:  # a plug-in source without an identity is not read
            raise SourceError(source, "kind", str(exc)) from None
        if plugin is not None:  # a plug-in reads its files: another version of it, another cache
            entry["plugin"] = plugin.model_dump(mode="json")
        described.append(entry)
    memo.save()
    blob = json.dumps(
        {"version": CACHE_VERSION, "preprocess": config.model_dump(mode="json"), "sources": described},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def settings_id(sources: list[Source], config: PreprocessConfig) -> str:
    """Hash of the settings alone (not the files): caches sharing it are versions of the same data."""
    blob = json.dumps([config.model_dump(mode="json"), [s.model_dump(mode="json") for s in sources]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _prune_versions(cache_dir: Path, keep: Path, settings: str) -> None:
    """Delete older caches of the same settings (their files changed since); open memmaps stay valid on POSIX."""
    for meta_file in cache_dir.glob("*/meta.json"):
        folder = meta_file.parent
        if folder == keep:
            continue
        try:
            same = json.loads(meta_file.read_text()).get("settings_id") == settings
        except (OSError, ValueError):
            continue
        if same:
            with FileLock(cache_dir / f"{folder.name}.lock"):  # waits for a reader mapping it
                shutil.rmtree(folder, ignore_errors=True)


def _write(sources: list[Source], config: PreprocessConfig, folder: Path) -> None:
    """Scan every source once, appending each kept record to its split's signal file."""
    reports: list[SourceReport] = []
    labels: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    ids: dict[str, list[str]] = {split: [] for split in SPLITS}
    with contextlib.ExitStack() as stack:
        files = {split: stack.enter_context((folder / f"{split}_signals.f32").open("wb")) for split in SPLITS}
        for source in sources:
            report = SourceReport(name=source.display_name, kind=source.kind, path=str(source.path))
            reports.append(report)
            for record in scan_source(source, config, report):
                split = "test" if record.is_test else "train"
                files[split].write(np.ascontiguousarray(record.signal, dtype=np.float32).tobytes())
                labels[split].append(multi_hot(record.classes))
                ids[split].append(f"{report.name}/{record.record_id}")
    for split in SPLITS:
        stacked = np.stack(labels[split]) if labels[split] else np.zeros((0, N_CLASSES), np.float32)
        np.save(folder / f"{split}_labels.npy", stacked)
    (folder / "report.json").write_text(json.dumps(LoadReport(reports).to_dict()))
    meta = {
        "version": CACHE_VERSION,
        "settings_id": settings_id(sources, config),
        "signal_len": config.signal_len,
        "n_leads": len(STANDARD_LEADS),
        "record_ids": ids,
    }
    (folder / "meta.json").write_text(json.dumps(meta))  # written last: its presence marks a full build


def _read(folder: Path) -> tuple[dict[str, CachedSplit], LoadReport]:
    meta = json.loads((folder / "meta.json").read_text())
    shape = (meta["n_leads"], meta["signal_len"])
    splits = {}
    for split in SPLITS:
        record_ids = tuple(meta["record_ids"][split])
        signals: npt.NDArray[np.float32]
        if record_ids:
            signals = np.memmap(folder / f"{split}_signals.f32", np.float32, "r", shape=(len(record_ids), *shape))
        else:
            signals = np.zeros((0, *shape), np.float32)
        labels = np.load(folder / f"{split}_labels.npy")
        splits[split] = CachedSplit(signals, labels, record_ids)
    return splits, LoadReport.from_dict(json.loads((folder / "report.json").read_text()))


def build_or_open(
    sources: list[Source], config: PreprocessConfig, cache_dir: Path
) -> tuple[dict[str, CachedSplit], LoadReport, Path]:
    """Open the cache of these sources and settings, building it first if it is missing or stale."""
    key = cache_key(sources, config, cache_dir)
    folder = cache_dir / key
    built = False
    with FileLock(cache_dir / f"{key}.lock"):
        if not (folder / "meta.json").exists():
            for stale in [*cache_dir.glob(f".{key}.*.building"), folder]:  # debris of a crash; we hold the lock
                shutil.rmtree(stale, ignore_errors=True)
            building = cache_dir / f".{key}.{uuid.uuid4().hex}.building"
            building.mkdir()
            try:
                _write(sources, config, building)
                os.replace(building, folder)
                built = True
            except BaseException:
                shutil.rmtree(building, ignore_errors=True)
                raise
        splits, report = _read(folder)  # mapped under the lock, so pruning cannot delete it half-read
    if built:
        _prune_versions(cache_dir, folder, settings_id(sources, config))
    return splits, report, folder
