"""GET /metrics in Prometheus text format, read from the database at scrape time (correct with many workers)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.api.deps import SessionDep
from coordinator.models import GlobalModel, Round, Site, Study, Update

router = APIRouter(tags=["status"])


def _seconds(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


class DatabaseCollector(Collector):
    """Counts rounds, uploads, bytes, aggregation time and site contact from the database."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def collect(self) -> Iterator[Metric]:
        """One scrape's worth of metric families."""
        s = self.session
        studies = GaugeMetricFamily("cardiofl_studies", "Studies by status.", labels=["status"])
        for status, count in s.execute(select(Study.status, func.count()).group_by(Study.status)):
            studies.add_metric([status], count)
        yield studies

        rounds = GaugeMetricFamily("cardiofl_rounds", "Round attempts by status.", labels=["status"])
        for status, count in s.execute(select(Round.status, func.count()).group_by(Round.status)):
            rounds.add_metric([status], count)
        yield rounds

        uploads, upload_bytes = s.execute(select(func.count(Update.id), func.coalesce(func.sum(Update.size), 0))).one()
        yield CounterMetricFamily("cardiofl_uploads", "Updates accepted from sites.", value=uploads)
        yield CounterMetricFamily("cardiofl_upload_bytes", "Bytes of accepted updates.", value=int(upload_bytes))
        models = s.scalar(select(func.count(GlobalModel.id))) or 0
        yield CounterMetricFamily("cardiofl_global_models", "Global models stored (round 0 included).", value=models)

        count, total = s.execute(
            select(func.count(Round.aggregation_seconds), func.coalesce(func.sum(Round.aggregation_seconds), 0.0))
        ).one()
        aggregation = SummaryMetricFamily(
            "cardiofl_aggregation_seconds", "Time from claiming a round for aggregation to its stored model."
        )
        aggregation.add_metric([], count_value=count, sum_value=float(total))
        yield aggregation

        seen = GaugeMetricFamily(
            "cardiofl_site_last_seen_timestamp_seconds", "Unix time of each site's last request.", labels=["site"]
        )
        for name, last in s.execute(select(Site.name, Site.last_seen_at)):
            stamp = _seconds(last)
            if stamp is not None:
                seen.add_metric([name], stamp)
        yield seen


@router.get("/metrics", include_in_schema=False)
def read_metrics(session: SessionDep) -> Response:
    """Prometheus exposition of the coordinator's counters (any admin, researcher or viewer token)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(session))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
