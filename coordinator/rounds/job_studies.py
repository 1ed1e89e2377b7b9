"""Studies without rounds (survey, evaluate): completed once every site reported, or settled at their deadline.

Each site of such a study reports its job once (coordinator/studies/reports.py); the report that
completes the set completes the study. Else, `round_deadline_s` after the study last became running
(started or resumed: `Study.updated_at`), the deadline tick (closing.py `tick`) completes it with at
least `min_sites` reports and fails it below. Every move is a conditional UPDATE of the study's status
taken under the study row's lock, so a report arriving at the deadline and the tick settle it once.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import exists, func, select, update
from sqlalchemy.engine import CursorResult  # an UPDATE's result, which Session.execute types as a Result
from sqlalchemy.orm import Session, sessionmaker

from coordinator import audit
from coordinator.models import Round, SiteReport, Study, StudyStatus
from coordinator.rounds.opening import SYSTEM

__all__ = ["complete_when_every_site_reported", "settle_job_studies", "study_for_update"]


def study_for_update(session: Session, study_id: int) -> Study | None:
    """The study, its row locked until the transaction ends (on PostgreSQL; SQLite's writers queue whole)."""
    return session.scalar(select(Study).where(Study.id == study_id).with_for_update())


def _reporting_sites(session: Session, study_id: int) -> int:
    """How many sites reported the study's one job (a survey or an evaluation: round 0)."""
    reporting = select(func.count(func.distinct(SiteReport.site_id))).where(SiteReport.study_id == study_id)
    return session.scalar(reporting) or 0


def _end(session: Session, study_id: int, status: StudyStatus, *, now: datetime, **detail: Any) -> bool:
    """Move the running study to `status` and audit it; False when it is no longer running. The caller commits."""
    moved = cast(
        "CursorResult[Any]",
        session.execute(
            update(Study)
            .where(Study.id == study_id, Study.status == StudyStatus.RUNNING)
            .values(status=status, updated_at=now)
        ),
    )
    if moved.rowcount != 1:
        return False
    audit.record(session, f"study.{status.value}", actor=SYSTEM, study_id=study_id, **detail)
    return True


def complete_when_every_site_reported(session: Session, study: Study, *, now: datetime) -> bool:
    """Complete the study (locked by the caller) when each of its sites has reported; whether it did."""
    reported = _reporting_sites(session, study.id)
    if reported < len(study.terms.sites):
        return False
    return _end(session, study.id, StudyStatus.COMPLETED, now=now, reported=reported)


def settle_job_studies(sessions: sessionmaker[Session], *, now: datetime) -> None:
    """Settle each running study without rounds whose deadline passed: completed at quorum, else failed."""
    with sessions() as session:
        running = session.scalars(
            select(Study.id)
            .where(Study.status == StudyStatus.RUNNING, ~exists().where(Round.study_id == Study.id))
            .order_by(Study.id)
        ).all()
        session.rollback()
    for study_id in running:
        with sessions() as session:
            study = study_for_update(session, study_id)
            if study is None or study.terms.kind == "train" or study.status != StudyStatus.RUNNING:
                continue
            terms = study.terms
            if now < study.updated_at + timedelta(seconds=terms.round_deadline_s):
                continue
            reported = _reporting_sites(session, study_id)
            if reported >= terms.min_sites:
                _end(session, study_id, StudyStatus.COMPLETED, now=now, reported=reported, note="deadline")
            else:
                reason = f"deadline: {reported} of {len(terms.sites)} sites reported, min_sites is {terms.min_sites}"
                _end(session, study_id, StudyStatus.FAILED, now=now, reported=reported, reason=reason)
            session.commit()
