"""A site's ECG data: WFDB and SPH sources, FedCVD preprocessing, the memory-mapped cache, batches, synthetic sites.

The loader (and with it torch) is imported on first use, so settings and CLI modules that only need
the source configs stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from site_agent.data.config import (
    ChallengeSource,
    DataSourceConfig,
    ManifestSource,
    PtbxlSource,
    SphSource,
    parse_source,
)
from site_agent.data.report import LoadReport, SkipReason, SourceReport
from site_agent.data.sources import SourceError

if TYPE_CHECKING:
    from site_agent.data.loader import (
        SiteData,
        SplitArrays,
        iterate_batches,
        open_site_data,
        require_records,
    )

__all__ = [
    "ChallengeSource",
    "DataSourceConfig",
    "LoadReport",
    "ManifestSource",
    "PtbxlSource",
    "SiteData",
    "SkipReason",
    "SourceError",
    "SourceReport",
    "SphSource",
    "SplitArrays",
    "iterate_batches",
    "open_site_data",
    "parse_source",
    "require_records",
]

_FROM_LOADER = {"SiteData", "SplitArrays", "iterate_batches", "open_site_data", "require_records"}


def __getattr__(name: str) -> Any:
    if name in _FROM_LOADER:
        from site_agent.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
