"""The three source layouts (PTB-XL, PhysioNet Challenge, manifest CSV): which records, which codes, which files."""

from __future__ import annotations

import ast
import csv
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.labels import LabelMap, default_label_map, label_map_from_mapping, read_label_map
from site_agent.data.config import ChallengeSource, ManifestSource, PtbxlSource

__all__ = [
    "RecordRef",
    "Source",
    "header_code_field",
    "list_records",
    "source_files",
    "source_label_map",
    "split_codes",
    "strip_wfdb_suffix",
]

Source = PtbxlSource | ChallengeSource | ManifestSource

PTBXL_DATABASE = "ptbxl_database.csv"
_WFDB_SUFFIXES = (".hea", ".mat", ".dat")
_LABEL_SEPARATORS = re.compile(r"[;,|]")


@dataclass(frozen=True)
class RecordRef:
    """One record a source lists, before it is read."""

    record_id: str  # unique within the source: path relative to its root, no extension
    path: Path  # WFDB record path without extension
    codes: tuple[str, ...] | None = None  # label codes known from a table; None: read the header
    split: str | None = None  # 'train'/'test' given by a manifest
    age: str | None = None  # demographics known from a table; None: read the header
    sex: str | None = None
    error: str | None = None  # the listing row itself is malformed


def source_label_map(source: Source) -> LabelMap:
    """The site's own map when given, else FedCVD's map for the source's code system."""
    if isinstance(source.label_map, Path):
        return read_label_map(source.label_map)
    if source.label_map is not None:
        return label_map_from_mapping(source.label_map)
    if isinstance(source, ManifestSource):
        return default_label_map(source.label_scheme)
    return default_label_map("ptbxl" if isinstance(source, PtbxlSource) else "snomed")


def header_code_field(source: Source) -> str:
    """Header comment that holds the labels when no table does: `Dx` (Challenge) or `Labels` (PTB-XL)."""
    return "labels" if isinstance(source, PtbxlSource) else "dx"


def split_codes(text: str) -> tuple[str, ...]:
    """'a, b;c' -> ('a', 'b', 'c')."""
    return tuple(code.strip() for code in _LABEL_SEPARATORS.split(text or "") if code.strip())


def strip_wfdb_suffix(text: str) -> str:
    """'a/b.hea' -> 'a/b' (also .mat, .dat)."""
    for suffix in _WFDB_SUFFIXES:
        if text.lower().endswith(suffix):
            return text[: -len(suffix)]
    return text


def _require(path: Path, what: str) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")


def _headers_under(root: Path, pattern: str) -> list[RecordRef]:
    return [
        RecordRef(record_id=header.relative_to(root).with_suffix("").as_posix(), path=header.with_suffix(""))
        for header in sorted(root.rglob(pattern))
        if header.is_file() and not any(part.startswith(".") for part in header.relative_to(root).parts)
    ]


def _ptbxl_rows(source: PtbxlSource) -> Iterator[RecordRef]:
    column = f"filename_{source.resolution}"
    with (source.path / PTBXL_DATABASE).open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {column, "scp_codes"} <= set(reader.fieldnames):
            raise ValueError(f"{source.path / PTBXL_DATABASE}: needs the columns scp_codes and {column}")
        for line, row in enumerate(reader, start=2):
            filename = (row[column] or "").strip()
            record_id = filename or f"line-{line}"
            try:
                scp = ast.literal_eval(row["scp_codes"] or "")  # a Python dict literal, never executed
                if not isinstance(scp, dict):
                    raise ValueError("not a dict")
            except (ValueError, SyntaxError) as exc:
                yield RecordRef(record_id, source.path / filename, error=f"scp_codes: {exc}")
                continue
            sex = {"0": "male", "1": "female"}.get((row.get("sex") or "").strip().split(".")[0])
            yield RecordRef(record_id, source.path / filename, codes=tuple(map(str, scp)), age=row.get("age"), sex=sex)


def _manifest_rows(source: ManifestSource) -> Iterator[RecordRef]:
    base = source.path.parent
    with source.path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        names = set(reader.fieldnames or [])
        record_column = "record" if "record" in names else "path"
        if record_column not in names or "labels" not in names:
            raise ValueError(f"{source.path}: a manifest needs the columns 'record' (or 'path') and 'labels'")
        for line, row in enumerate(reader, start=2):
            record = strip_wfdb_suffix((row[record_column] or "").strip().replace("\\", "/"))
            split = (row.get("split") or "").strip().lower() or None
            error = None
            if not record:
                error = "empty record path"
            elif split not in (None, "train", "test"):
                error = f"split must be train or test, got {split!r}"
            yield RecordRef(
                record_id=record or f"line-{line}",
                path=base / record,
                codes=split_codes(row["labels"] or ""),
                split=split,
                age=row.get("age"),
                sex=row.get("sex"),
                error=error,
            )


def list_records(source: Source) -> list[RecordRef]:
    """Every record the source lists, in a stable order."""
    _require(source.path, f"{source.kind} source")
    if isinstance(source, ManifestSource):
        return list(_manifest_rows(source))
    if isinstance(source, PtbxlSource):
        if (source.path / PTBXL_DATABASE).exists():
            return list(_ptbxl_rows(source))
        return _headers_under(source.path, f"*_{source.resolution}.hea")
    return _headers_under(source.path, "*.hea")


def source_files(source: Source, exclude: Path | None = None) -> list[Path]:
    """The files whose content defines the source (the cache key hashes them), sorted."""
    _require(source.path, f"{source.kind} source")
    extra = [p for p in (source.split_file, source.label_map) if isinstance(p, Path)]
    if isinstance(source, ManifestSource):
        wanted: dict[Path, set[str]] = {}
        for ref in _manifest_rows(source):
            wanted.setdefault(ref.path.parent, set()).add(ref.path.name)
        files = [source.path]
        for folder, stems in wanted.items():
            if folder.is_dir():
                files += [p for p in folder.iterdir() if p.is_file() and p.name.rsplit(".", 1)[0] in stems]
        return sorted(set(files + extra))
    root = source.path.resolve()
    excluded = exclude.resolve() if exclude is not None else None
    files = [
        p
        for p in root.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
        and (excluded is None or not p.is_relative_to(excluded))
    ]
    return sorted(files + extra)
