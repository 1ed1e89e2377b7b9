"""The record kept beside a partial download: the body's size and strong ETag, read back before resuming it."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_kept_record"]


def read_kept_record(path: Path) -> tuple[int, str] | None:
    """(size, ETag) the kept bytes came with, from the JSON at `path`; None when it is missing or not such a record."""
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    size, etag = (raw.get("size"), raw.get("etag")) if isinstance(raw, dict) else (None, None)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(etag, str) or not etag:
        return None
    return size, etag
