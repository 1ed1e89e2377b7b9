"""One record a source lists, before it is read: what every source layout, a plug-in's too, yields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["RecordRef"]


@dataclass(frozen=True)
class RecordRef:
    """One record a source lists, before it is read."""

    record_id: str  # unique within the source: path relative to its root, no extension
    path: Path  # WFDB record path without extension, or an SPH record's .h5 file
    codes: tuple[str, ...] | None = None  # label codes known from a table; None: read the header
    split: str | None = None  # 'train'/'test' given by a manifest
    age: str | None = None  # demographics known from a table; None: read the header
    sex: str | None = None
    error: str | None = None  # the listing row itself is malformed
