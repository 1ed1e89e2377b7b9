"""What /metrics shows of each study: its rounds, its latest Global reading, epsilon spent, and its sites.

Every figure is read through the study's and the round's read models (views.py), so a gauge always
equals what GET /api/v1/studies/{id} and its /rounds report. A scrape costs a fixed number of
queries per study shown, whatever the number of its rounds: the study's view, one grouped query for
every study's last two completed training rounds, and the view of one of them (of both when the
latest has no Global reading yet).

Only studies still open (draft, running, paused) and those that finished within FINISHED_SHOWN_FOR
are shown, so the label set {study_id, study} stays bounded however many studies a coordinator ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from coordinator.models import Round, RoundKind, RoundStatus, Site, Study, StudyStatus
from coordinator.sites.approvals import APPROVED
from coordinator.studies.views import round_view, study_view
from shared.wire.metrics import MetricSummary, PrivacySpent

__all__ = ["FINISHED_SHOWN_FOR", "LIVE_WITHIN", "StudyGauges", "sites_last_seen", "study_gauges"]

LIVE_WITHIN = timedelta(seconds=120)  # a site seen this recently is live (as on the dashboard's site table)
FINISHED_SHOWN_FOR = timedelta(days=1)  # a finished study's last figures stay exposed this long after it ended
OPEN = (StudyStatus.DRAFT, StudyStatus.RUNNING, StudyStatus.PAUSED)


@dataclass(frozen=True)
class StudyGauges:
    """One study's figures; None where the API shows none (no open round, no reading yet, no DP)."""

    study_id: int
    name: str
    status: str
    planned_rounds: int  # T of its terms
    completed_rounds: int  # t of its latest global model theta^g_t
    current_round: int | None  # the round open or aggregating
    eval_round: int | None  # t of the latest theta^g_t with a pooled Global reading
    micro_f1: float | None  # that reading's pooled micro-F1 ...
    map: float | None  # ... and mAP
    epsilon: float | None  # spent by the models released so far, under differential privacy
    epsilon_budget: float | None
    sites_listed: int
    sites_approved: int
    sites_live: int  # listed sites seen within LIVE_WITHIN


def sites_last_seen(session: Session) -> dict[str, datetime | None]:
    """Every enrolled site's last authenticated request, by name."""
    return dict(session.execute(select(Site.name, Site.last_seen_at)).all())


def _last_completed_rounds(session: Session, study_ids: list[int]) -> dict[int, list[Round]]:
    """Each study's last two completed training rounds, newest first: one grouped query for every study."""
    if not study_ids:
        return {}
    trained = (Round.status == RoundStatus.COMPLETED, Round.kind == RoundKind.TRAIN)
    latest = (
        select(Round.study_id, func.max(Round.number).label("number"))
        .where(Round.study_id.in_(study_ids), *trained)
        .group_by(Round.study_id)
        .subquery()
    )
    rounds = session.scalars(
        select(Round)
        .join(latest, (Round.study_id == latest.c.study_id) & (Round.number >= latest.c.number - 1))
        .where(*trained)
        .order_by(Round.study_id, Round.number.desc())
    )
    found: dict[int, list[Round]] = {}
    for round_ in rounds:
        found.setdefault(round_.study_id, []).append(round_)
    return found


def _latest_reading(session: Session, study: Study, candidates: Iterable[Round]) -> tuple[int, MetricSummary] | None:
    """(t, pooled Global summary) of the newest candidate round whose view shows one (round_view pairs t with t+1)."""
    for round_ in candidates:
        pooled = round_view(session, study, round_).pooled
        if pooled is not None and pooled.eval is not None:
            return round_.number, pooled.eval
    return None


def _live(names: Iterable[str], seen: Mapping[str, datetime | None], since: datetime) -> int:
    return sum(1 for name in names if (last := seen.get(name)) is not None and last >= since)


def study_gauges(session: Session, now: datetime, seen: Mapping[str, datetime | None]) -> list[StudyGauges]:
    """The figures of the studies shown (open, or finished within FINISHED_SHOWN_FOR), by id."""
    studies = session.scalars(
        select(Study)
        .where(or_(Study.status.in_(OPEN), Study.updated_at >= now - FINISHED_SHOWN_FOR))
        .order_by(Study.id)
    ).all()
    candidates = _last_completed_rounds(session, [study.id for study in studies])
    gauges = []
    for study in studies:
        view = study_view(session, study)
        reading = _latest_reading(session, study, candidates.get(study.id, ()))
        summary = reading[1] if reading is not None else MetricSummary()
        privacy = view.privacy or PrivacySpent()
        gauges.append(
            StudyGauges(
                study_id=study.id,
                name=study.name,
                status=study.status,
                planned_rounds=study.terms.rounds,
                completed_rounds=view.completed_rounds,
                current_round=view.current_round,
                eval_round=reading[0] if reading is not None else None,
                micro_f1=summary.micro_f1,
                map=summary.map,
                epsilon=privacy.epsilon,
                epsilon_budget=privacy.epsilon_budget,
                sites_listed=len(view.approvals),
                sites_approved=sum(1 for state in view.approvals.values() if state == APPROVED),
                sites_live=_live(view.approvals, seen, now - LIVE_WITHIN),
            )
        )
    return gauges
