"""GET /metrics in Prometheus text format, read from the database at scrape time (correct with many workers).

Coordinator-wide counters and gauges (buffered studies' update staleness by site among them), then
per-study gauges labelled {study_id, study} (its id and name) for the studies
coordinator/studies/gauges.py shows: those open, and those finished lately.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.api.deps import SessionDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.models import GlobalModel, Round, Site, Study, Update
from coordinator.studies.gauges import (
    FINISHED_SHOWN_FOR,
    LIVE_WITHIN,
    StudyGauges,
    sites_last_seen,
    study_gauges,
)

router = APIRouter(tags=["status"], route_class=SessionReleasingRoute)

STUDY_LABELS = ["study_id", "study"]
_SHOWN = (
    "Labels: study_id, study (its name); only studies open, or finished in the last "
    f"{FINISHED_SHOWN_FOR.total_seconds() / 3600:g} h."
)
# The per-study gauges: name, the StudyGauges field it shows, help. A study whose field is None has no sample.
STUDY_GAUGES = [
    ("cardiofl_study_rounds_planned", "planned_rounds", "Training rounds T of the study's terms."),
    ("cardiofl_study_rounds_completed", "completed_rounds", "Rounds completed: t of the latest global model."),
    ("cardiofl_study_current_round", "current_round", "The round open or aggregating (absent when none is)."),
    ("cardiofl_study_global_eval_round", "eval_round", "Round t of the latest pooled Global reading (theta^g_t)."),
    ("cardiofl_study_global_micro_f1", "micro_f1", "Pooled micro-F1 of the latest Global reading."),
    ("cardiofl_study_global_map", "map", "Pooled mAP (over all classes) of the latest Global reading."),
    ("cardiofl_study_dp_epsilon", "epsilon", "Epsilon spent by the models released so far (DP studies only)."),
    ("cardiofl_study_dp_epsilon_budget", "epsilon_budget", "Epsilon budget of the terms (DP studies with one only)."),
    ("cardiofl_study_sites", "sites_listed", "Sites the study lists."),
    ("cardiofl_study_sites_approved", "sites_approved", "Listed sites whose operator approved the study."),
    (
        "cardiofl_study_sites_live",
        "sites_live",
        f"Listed sites seen by the coordinator in the last {LIVE_WITHIN.total_seconds():g} s.",
    ),
]


def _seconds(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


class DatabaseCollector(Collector):
    """Counts rounds, uploads, bytes, aggregation time and site contact, and each shown study's gauges."""

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
        assert total is not None  # coalesce(sum, 0.0) is never NULL
        aggregation = SummaryMetricFamily(
            "cardiofl_aggregation_seconds", "Time from claiming a round for aggregation to its stored model."
        )
        aggregation.add_metric([], count_value=count, sum_value=float(total))
        yield aggregation

        yield _staleness(s)

        last_seen = sites_last_seen(s)
        seen = GaugeMetricFamily(
            "cardiofl_site_last_seen_timestamp_seconds", "Unix time of each site's last request.", labels=["site"]
        )
        for name, last in last_seen.items():
            stamp = _seconds(last)
            if stamp is not None:
                seen.add_metric([name], stamp)
        yield seen
        yield from study_families(study_gauges(s, utc_now(), last_seen))


def _staleness(session: Session) -> Metric:
    """Buffered studies' accepted updates by site: how many, and their staleness summed (versions behind)."""
    family = SummaryMetricFamily(
        "cardiofl_update_staleness",
        "Versions behind the buffer it joined, of each accepted update of a buffered study.",
        labels=["site"],
    )
    rows = session.execute(
        select(Site.name, func.count(Update.id), func.sum(Round.number - 1 - Update.base_round))
        .join(Round, Update.round_id == Round.id)
        .join(Site, Update.site_id == Site.id)
        .where(Update.base_round.is_not(None))
        .group_by(Site.name)
        .order_by(Site.name)
    )
    for name, count, total in rows:
        family.add_metric([name], count_value=count, sum_value=float(total or 0))
    return family


def study_families(gauges: Sequence[StudyGauges]) -> Iterator[Metric]:
    """The per-study gauges, and cardiofl_study_info (1, with the study's status as a third label)."""
    info = GaugeMetricFamily(
        "cardiofl_study_info", f"Always 1, labelled with the study's status. {_SHOWN}", labels=[*STUDY_LABELS, "status"]
    )
    for g in gauges:
        info.add_metric([str(g.study_id), g.name, g.status], 1)
    yield info
    for name, field, help_text in STUDY_GAUGES:
        family = GaugeMetricFamily(name, f"{help_text} {_SHOWN}", labels=STUDY_LABELS)
        for g in gauges:
            value = getattr(g, field)
            if value is not None:
                family.add_metric([str(g.study_id), g.name], value)
        yield family


@router.get("/metrics", include_in_schema=False)
def read_metrics(session: SessionDep) -> Response:
    """Prometheus exposition of the coordinator's counters (any admin, researcher or viewer token)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(session))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
