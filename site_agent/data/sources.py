"""The source layouts (PTB-XL, PhysioNet Challenge, manifest CSV, SPH): which records, which codes, which files."""

from __future__ import annotations

import ast
import csv
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from site_agent.data.config import ManifestSource, PtbxlSource, RecordSource, SourceConfig, SphSource
from site_agent.data.label_maps import (
    LabelMap,
    combined_label_map,
    default_label_map,
    label_map_from_mapping,
    read_label_map,
)
from site_agent.data.record_ref import RecordRef

__all__ = [
    "FEDCVD_SPLIT_FILES",
    "SPH_METADATA",
    "SPH_RECORDS",
    "RecordRef",
    "Source",
    "SourceError",
    "header_code_field",
    "list_records",
    "reading",
    "source_files",
    "source_label_map",
    "split_codes",
    "strip_wfdb_suffix",
]

Source = SourceConfig

PTBXL_DATABASE = "ptbxl_database.csv"
SPH_METADATA = "metadata.csv"
SPH_RECORDS = "records"  # SPH's folder of <ECG_ID>.h5 files
_WFDB_SUFFIXES = (".hea", ".mat", ".dat")
FEDCVD_SPLIT_FILES = ("train.csv", "test.csv")  # in FedCVD's appendix/ECG/clientK folders
# '+' joins an SPH (AHA) statement to its modifiers: '22;50+346' is 22, 50 and 346, as FedCVD reads it.
_LABEL_SEPARATORS = re.compile(r"[;,|+]")


class SourceError(ValueError):
    """A source cannot be read as configured; `setting` names its field at fault (path, label_map ...)."""

    def __init__(self, source: Source, setting: str, message: str) -> None:
        super().__init__(message)
        self.source, self.setting = source, setting


def _reason(exc: Exception) -> str:
    """A short cause for a failed read: the OS error's text, or what the parser said."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.object[exc.start : exc.start + 1]!r} at offset {exc.start})"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)


@contextmanager
def reading(source: Source, setting: str, path: Path) -> Iterator[None]:
    """Turn a failure to read or parse `path` into a SourceError naming `setting`."""
    try:
        yield
    except SourceError:
        raise
    except (OSError, ValueError, csv.Error) as exc:
        reason = _reason(exc)
        named = reason.startswith((f"{path}:", f"{path}/"))  # the parser named the file (or one inside the folder)
        message = reason if named else f"cannot read {path}: {reason}"
        raise SourceError(source, setting, message) from None


def _check_path(source: Source) -> None:
    """A manifest's path must be a file (its CSV), any other source's a folder of records."""
    if not source.path.exists():
        raise SourceError(source, "path", f"{source.path} does not exist")
    if isinstance(source, RecordSource):
        return  # a plug-in's path may be a folder or a file: the plug-in knows
    if isinstance(source, ManifestSource) and source.path.is_dir():
        raise SourceError(source, "path", f"{source.path} is a folder; a manifest source is a CSV file of records")
    if not isinstance(source, ManifestSource) and not source.path.is_dir():
        raise SourceError(source, "path", f"{source.path} is a file; a {source.kind} source is a folder of records")


def source_label_map(source: Source) -> LabelMap:
    """The site's own map when given, else FedCVD's map for the source's code system."""
    if isinstance(source.label_map, Path):
        with reading(source, "label_map", source.label_map):
            return read_label_map(source.label_map)
    if source.label_map is not None:
        try:
            return label_map_from_mapping(source.label_map)
        except ValueError as exc:
            raise SourceError(source, "label_map", f"invalid label map: {exc}") from None
    if isinstance(source, ManifestSource):
        scheme = source.label_scheme
        return default_label_map(scheme) if scheme in ("auto", "name") else combined_label_map("name", scheme)
    if isinstance(source, SphSource):
        return default_label_map("aha")
    if isinstance(source, RecordSource):
        return default_label_map(source.label_scheme)
    return default_label_map("ptbxl" if isinstance(source, PtbxlSource) else "snomed")


def header_code_field(source: Source) -> str:
    """Header comment that holds the labels when no table does: `Dx` (Challenge) or `Labels` (PTB-XL)."""
    return "labels" if isinstance(source, PtbxlSource) else "dx"


def split_codes(text: str) -> tuple[str, ...]:
    """'a, b;c|d+e' -> ('a', 'b', 'c', 'd', 'e')."""
    return tuple(code.strip() for code in _LABEL_SEPARATORS.split(text or "") if code.strip())


def strip_wfdb_suffix(text: str) -> str:
    """'a/b.hea' -> 'a/b' (also .mat, .dat)."""
    for suffix in _WFDB_SUFFIXES:
        if text.lower().endswith(suffix):
            return text[: -len(suffix)]
    return text


def _headers_under(root: Path, pattern: str) -> list[RecordRef]:
    return [
        RecordRef(record_id=header.relative_to(root).with_suffix("").as_posix(), path=header.with_suffix(""))
        for header in sorted(root.rglob(pattern))
        if header.is_file() and not any(part.startswith(".") for part in header.relative_to(root).parts)
    ]


def _ptbxl_rows(source: PtbxlSource) -> Iterator[RecordRef]:
    column = f"filename_{source.resolution}"
    database = source.path / PTBXL_DATABASE
    with reading(source, "path", database), database.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {column, "scp_codes"} <= set(reader.fieldnames):
            raise SourceError(source, "path", f"{database}: needs the columns scp_codes and {column}")
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


def _sph_rows(source: SphSource) -> Iterator[RecordRef]:
    metadata = source.path / SPH_METADATA
    with reading(source, "path", metadata), metadata.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {"ECG_ID", "AHA_Code"} <= set(reader.fieldnames):
            raise SourceError(source, "path", f"{metadata}: needs the columns ECG_ID and AHA_Code")
        for line, row in enumerate(reader, start=2):
            ecg_id = (row["ECG_ID"] or "").strip()
            error = None
            if not ecg_id or "/" in ecg_id or "\\" in ecg_id or ecg_id.startswith("."):
                error = f"ECG_ID {ecg_id!r} is not a record name"
            yield RecordRef(
                record_id=ecg_id if not error else f"line-{line}",
                path=source.path / SPH_RECORDS / f"{ecg_id}.h5",
                codes=split_codes(row["AHA_Code"] or ""),
                age=row.get("Age"),
                sex=row.get("Sex"),
                error=error,
            )


def _manifest_columns(source: ManifestSource, header: list[str] | None) -> str:
    """The record column of a manifest with this header row; a missing column raises SourceError."""
    if not header:
        raise SourceError(source, "path", f"{source.path} is empty; a manifest starts with a header row of columns")
    names = set(header)
    found = ", ".join(repr(name) for name in header)
    record_column = source.record_column or ("record" if "record" in names else "path")
    if record_column not in names:
        wanted = repr(source.record_column) if source.record_column else "'record' (or 'path')"
        raise SourceError(source, "record_column", f"{source.path}: no record column {wanted}; its columns: {found}")
    missing = [name for name in source.label_columns if name not in names]
    if missing:
        message = f"{source.path}: no label column {missing[0]!r}; its columns: {found}"
        raise SourceError(source, "label_column", message)
    return record_column


def _manifest_rows(source: ManifestSource) -> Iterator[RecordRef]:
    base = source.path.parent
    with reading(source, "path", source.path), source.path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        record_column = _manifest_columns(source, list(reader.fieldnames) if reader.fieldnames else None)
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
                codes=tuple(code for column in source.label_columns for code in split_codes(row[column] or "")),
                split=split,
                age=row.get("age"),
                sex=row.get("sex"),
                error=error,
            )


def list_records(source: Source) -> list[RecordRef]:
    """Every record the source lists, in a stable order."""
    _check_path(source)
    if isinstance(source, RecordSource):
        with reading(source, "path", source.path):
            return list(source.records())
    if isinstance(source, ManifestSource):
        return list(_manifest_rows(source))
    if isinstance(source, SphSource):
        return list(_sph_rows(source))
    if isinstance(source, PtbxlSource):
        if (source.path / PTBXL_DATABASE).exists():
            return list(_ptbxl_rows(source))
        return _headers_under(source.path, f"*_{source.resolution}.hea")
    return _headers_under(source.path, "*.hea")


def source_files(source: Source, exclude: Path | None = None) -> list[Path]:
    """The files whose content defines the source (the cache key hashes them), sorted."""
    _check_path(source)
    extra = [p for p in (source.split_file, source.label_map) if isinstance(p, Path)]
    if source.fedcvd_split is not None:
        extra += [source.fedcvd_split / name for name in FEDCVD_SPLIT_FILES]
    if isinstance(source, RecordSource):  # the cache a site keeps under its source is not part of it
        excluded = exclude.resolve() if exclude is not None else None
        listed = [p for p in source.files() if excluded is None or not p.resolve().is_relative_to(excluded)]
        return sorted(set(listed + extra))
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
    return sorted(set(files + extra))
