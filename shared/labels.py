"""The 20 FedCVD ECG classes a study's model predicts (its terms' `labels`), with the source codes of each.

The classes and code lists are data (`label_maps.json`, FedCVD's `labels_map`), not literals here.
A site turns the codes of its records into these classes with site_agent/data/label_maps.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

from shared.errors import ModelConfigError

__all__ = ["CLASS_NAMES", "CLASSES", "N_CLASSES", "SCHEMES", "EcgClass", "class_index", "normalize_code"]

SCHEMES = ("ptbxl", "snomed", "aha")  # the code systems listed per class in label_maps.json


@dataclass(frozen=True)
class EcgClass:
    """One FedCVD class: its index, short name and the source codes merged into it."""

    index: int
    name: str
    description: str
    codes: Mapping[str, tuple[str, ...]]  # scheme -> codes, first one preferred when writing


def _load_classes() -> tuple[EcgClass, ...]:
    data = json.loads(resources.files("shared").joinpath("label_maps.json").read_text(encoding="utf-8"))
    classes = tuple(
        EcgClass(
            index=entry["index"],
            name=entry["name"],
            description=entry["description"],
            codes=MappingProxyType({scheme: tuple(entry[scheme]) for scheme in SCHEMES}),
        )
        for entry in data["classes"]
    )
    if [c.index for c in classes] != list(range(len(classes))):
        raise RuntimeError("label_maps.json: class indices must be 0..N-1 in order")
    return classes


CLASSES: tuple[EcgClass, ...] = _load_classes()
CLASS_NAMES: tuple[str, ...] = tuple(c.name for c in CLASSES)
N_CLASSES = len(CLASSES)


def normalize_code(code: str) -> str:
    """Codes compare case-insensitively and without surrounding blanks."""
    return code.strip().upper()


def class_index(name: str) -> int:
    """Index of a class given its short name (case-insensitive), e.g. 'afib' -> 5."""
    key = normalize_code(name)
    for c in CLASSES:
        if normalize_code(c.name) == key:
            return c.index
    raise ModelConfigError(f"unknown ECG class {name!r}; known: {', '.join(CLASS_NAMES)}")
