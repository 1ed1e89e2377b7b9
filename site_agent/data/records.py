"""Reading one WFDB record defensively: header fields, the 12 standard leads in order, signals in mV."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import numpy.typing as npt
import wfdb

from site_agent.data.report import SkipReason

__all__ = [
    "STANDARD_LEADS",
    "RecordSkipped",
    "header_fields",
    "lead_order",
    "read_header",
    "read_signal",
]

STANDARD_LEADS = ("I", "II", "III", "aVR", "aVL", "aVF", "V1", "V2", "V3", "V4", "V5", "V6")
_LEAD_INDEX = {lead.upper(): i for i, lead in enumerate(STANDARD_LEADS)}
_MILLIVOLTS_PER_UNIT = {"mv": 1.0, "uv": 1e-3, "µv": 1e-3, "μv": 1e-3, "v": 1e3, "": 1.0}


class RecordSkipped(Exception):
    """A record cannot be used; `reason` is counted in the load report."""

    def __init__(self, reason: SkipReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


def read_header(path: Path) -> wfdb.Record:
    """The WFDB header of the record at `path` (no extension); any failure is `unreadable`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # wfdb warns about odd but readable headers
            return wfdb.rdheader(str(path))
    except Exception as exc:  # a corrupt file must never stop the site: wfdb raises many types
        raise RecordSkipped(SkipReason.UNREADABLE, f"header: {type(exc).__name__}: {exc}") from exc


def header_fields(comments: list[str] | None) -> dict[str, str]:
    """`Key: value` header comments (`#Dx:`, `#Age:`, `# Labels:` ...) as {lowercase key: value}."""
    fields: dict[str, str] = {}
    for comment in comments or []:
        key, sep, value = comment.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


def lead_order(sig_names: list[str] | None) -> list[int]:
    """Channel index of each standard lead, in STANDARD_LEADS order; names match case-insensitively."""
    found: dict[int, int] = {}
    for channel, name in enumerate(sig_names or []):
        lead = _LEAD_INDEX.get(str(name).strip().upper())
        if lead is None:
            continue  # extra channels (Frank leads, annotations) are ignored
        if lead in found:
            raise RecordSkipped(SkipReason.DUPLICATE_LEAD, STANDARD_LEADS[lead])
        found[lead] = channel
    missing = [STANDARD_LEADS[i] for i in range(len(STANDARD_LEADS)) if i not in found]
    if missing:
        raise RecordSkipped(SkipReason.MISSING_LEAD, ",".join(missing))
    return [found[i] for i in range(len(STANDARD_LEADS))]


def _millivolt_factors(units: list[str] | None, channels: list[int]) -> npt.NDArray[np.float64]:
    factors = []
    for channel in channels:
        unit = (units[channel] if units and channel < len(units) and units[channel] else "").strip().lower()
        if unit not in _MILLIVOLTS_PER_UNIT:
            raise RecordSkipped(SkipReason.UNKNOWN_UNITS, unit)
        factors.append(_MILLIVOLTS_PER_UNIT[unit])
    return np.asarray(factors)[:, None]


def read_signal(path: Path, header: wfdb.Record) -> npt.NDArray[np.float64]:
    """The 12 standard leads as a (12, T) float64 array in mV, reordered from the header's channels."""
    channels = lead_order(header.sig_name)
    factors = _millivolt_factors(header.units, channels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            record = wfdb.rdrecord(str(path))
    except Exception as exc:  # truncated or missing signal files raise many types inside wfdb
        raise RecordSkipped(SkipReason.UNREADABLE, f"signal: {type(exc).__name__}: {exc}") from exc
    signal: npt.NDArray[np.float64] | None = record.p_signal  # wfdb is untyped: physical float64, or None
    if signal is None or signal.ndim != 2 or signal.shape[1] != len(header.sig_name or []):
        raise RecordSkipped(SkipReason.UNREADABLE, "signal shape does not match the header")
    return signal[:, channels].T * factors
