"""A site's maps from its records' label codes (PTB-XL SCP, SNOMED-CT, SPH/AHA, its own) to the FedCVD classes.

A `LabelMap` turns the codes found in one record into class indices (shared/labels.py); a site can
supply its own map (JSON `{"code": "CLASS"}` or a CSV with `code,class` columns) for an archive with
other codes.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import MappingProxyType

import numpy as np

from shared.labels import CLASSES, N_CLASSES, SCHEMES, class_index, normalize_code

__all__ = [
    "LabelMap",
    "combined_label_map",
    "default_label_map",
    "label_map_from_mapping",
    "multi_hot",
    "read_label_map",
]


def multi_hot(indices: Iterable[int], n_classes: int = N_CLASSES) -> np.ndarray:
    """A float32 multi-hot vector with ones at `indices`."""
    vector = np.zeros(n_classes, dtype=np.float32)
    vector[list(indices)] = 1.0
    return vector


@dataclass(frozen=True)
class LabelMap:
    """Maps a source's label codes to FedCVD class indices."""

    scheme: str  # where the codes come from: ptbxl, snomed, aha, name, auto or custom
    codes: Mapping[str, tuple[int, ...]]  # normalized code -> class indices

    def classes_of(self, codes: Iterable[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Sorted class indices of `codes`, and the codes that map to no class (in order, once each)."""
        found: set[int] = set()
        unmapped: dict[str, None] = {}
        for code in codes:
            key = normalize_code(code)
            if not key:
                continue
            if key in self.codes:
                found.update(self.codes[key])
            else:
                unmapped[code.strip()] = None
        return tuple(sorted(found)), tuple(unmapped)

    def encode(self, codes: Iterable[str]) -> np.ndarray:
        """Multi-hot float32 vector of the classes of `codes`; unknown codes are ignored."""
        return multi_hot(self.classes_of(codes)[0])


def _build(scheme: str, pairs: Iterable[tuple[str, int]]) -> LabelMap:
    codes: dict[str, set[int]] = {}
    for code, index in pairs:
        if not 0 <= index < N_CLASSES:
            raise ValueError(f"label map {scheme}: class index {index} out of range 0..{N_CLASSES - 1}")
        codes.setdefault(normalize_code(code), set()).add(index)
    return LabelMap(scheme, MappingProxyType({code: tuple(sorted(ix)) for code, ix in codes.items()}))


@cache
def default_label_map(scheme: str) -> LabelMap:
    """The FedCVD map for one code system: 'ptbxl', 'snomed', 'aha', 'name' (class names) or 'auto'.

    'auto' accepts class names, PTB-XL SCP codes and SNOMED-CT codes (they never collide); AHA codes
    are small integers and must be asked for explicitly.
    """
    if scheme in SCHEMES:
        return _build(scheme, ((code, c.index) for c in CLASSES for code in c.codes[scheme]))
    if scheme == "name":
        return _build(scheme, ((c.name, c.index) for c in CLASSES))
    if scheme == "auto":
        return combined_label_map("name", "ptbxl", "snomed", scheme="auto")
    raise ValueError(f"unknown label scheme {scheme!r}; choose one of {[*SCHEMES, 'name', 'auto']}")


@cache
def combined_label_map(*schemes: str, scheme: str | None = None) -> LabelMap:
    """One map that accepts the codes of each of `schemes` (e.g. class names and SNOMED-CT codes)."""
    merged: dict[str, tuple[int, ...]] = {}
    for part in (default_label_map(s) for s in schemes):
        for code, indices in part.codes.items():
            if merged.get(code, indices) != indices:
                raise RuntimeError(f"label_maps.json: code {code!r} means different classes in different schemes")
            merged[code] = indices
    return LabelMap(scheme or "+".join(schemes), MappingProxyType(merged))


def _class_of(value: str | int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return class_index(value)
    raise ValueError(f"label map values must be class names or indices, got {value!r}")


def label_map_from_mapping(mapping: Mapping[str, str | int | Sequence[str | int]], scheme: str = "custom") -> LabelMap:
    """A site's own map: each code -> a class name (or index), or a list of them."""
    pairs: list[tuple[str, int]] = []
    for code, target in mapping.items():
        targets = [target] if isinstance(target, str | int) else list(target)
        if not targets:
            raise ValueError(f"label map: code {code!r} maps to no class")
        pairs.extend((str(code), _class_of(t)) for t in targets)
    if not pairs:
        raise ValueError("label map is empty")
    return _build(scheme, pairs)


def read_label_map(path: Path) -> LabelMap:
    """Read a site's map from JSON (`{"code": "CLASS" | ["CLASS", ...]}`) or CSV (columns `code,class`)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object mapping codes to class names")
        return label_map_from_mapping(data, scheme=f"custom:{path.name}")
    rows = list(csv.DictReader(text.splitlines()))
    if not rows or not {"code", "class"} <= set(rows[0]):
        raise ValueError(f"{path}: expected a CSV with columns 'code' and 'class'")
    mapping: dict[str, list[str]] = {}
    for row in rows:
        mapping.setdefault(row["code"], []).append(row["class"])
    return label_map_from_mapping(mapping, scheme=f"custom:{path.name}")
