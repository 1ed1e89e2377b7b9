"""A site's ECG data: WFDB sources, FedCVD preprocessing, the memory-mapped cache, batches, synthetic sites."""

from site_agent.data.config import ChallengeSource, DataSourceConfig, ManifestSource, PtbxlSource, parse_source
from site_agent.data.loader import SiteData, SplitArrays, iterate_batches, open_site_data
from site_agent.data.report import LoadReport, SkipReason, SourceReport

__all__ = [
    "ChallengeSource",
    "DataSourceConfig",
    "LoadReport",
    "ManifestSource",
    "PtbxlSource",
    "SiteData",
    "SkipReason",
    "SourceReport",
    "SplitArrays",
    "iterate_batches",
    "open_site_data",
    "parse_source",
]
