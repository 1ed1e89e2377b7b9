"""Accepting a site's report of a job outside rounds (shared/wire/jobs.py): checked against the terms, then stored.

Refusals, in the order checked, nothing stored: a study that does not list the site, or none at all
(403 not_a_participant, alike); a body whose kind or round is not the path's (422 report_mismatch); a
kind that is not the site's job in the study (409 wrong_job); a report already stored with another
body (409 report_conflict; the same body again answers the stored one); a site that has not approved
the study (409 not_approved); a study that takes no report now (409 study_not_running: a survey or an
evaluation while running, an external validation while its study runs or once it completed); a round
not released or not due (409 round_not_due); a survey not released as the terms say, an evaluation's
clinical figures of fewer than privacy.min_records records, or an adapted evaluation that the terms
do not ask for or one missing (422 invalid_report). Every refusal after the first is an audit event.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.errors import CoordinatorError, InvalidReport, JobNotDue, NotAParticipant, ReportConflict
from coordinator.models import GlobalModel, SiteReport, Study, StudyStatus
from coordinator.rounds.job_studies import complete_when_every_site_reported, study_for_update
from coordinator.sites.approvals import approved_study_ids
from coordinator.sites.security import Principal
from coordinator.studies.jobs import external_rounds_due, final_round, job_roles
from shared.evaluation.summaries import check_reports
from shared.terms import StudyTerms
from shared.wire.jobs import JobKind, JobReport
from shared.wire.protocol import EvalSummary
from shared.wire.survey_release import release_problem

__all__ = ["accept_report", "stored_report"]


def stored_report(row: SiteReport) -> JobReport:
    """The report as the site sent it, from its stored row."""
    return JobReport.model_validate(row.body)


def accept_report(
    session: Session, *, study_id: int, site: Principal, kind: JobKind, number: int, report: JobReport, now: datetime
) -> tuple[JobReport, bool]:
    """Store `site`'s report of its job `kind` (round `number`) of study `study_id`: (the stored report, whether new).

    The study's row stays locked until the commit, so the report that completes a survey or an
    evaluation is counted with every other one (coordinator/rounds/job_studies.py).
    """
    assert site.site_id is not None and site.site_name is not None
    study = study_for_update(session, study_id)
    if study is None or site.site_name not in study.terms.listed_sites:
        raise NotAParticipant.of_study(site.site_name, study_id)
    try:
        existing = _admit(session, study, site, kind, number, report)
        if existing is not None:
            return existing, False
        _check_content(study.terms, report)
    except CoordinatorError as exc:
        session.rollback()
        audit.record(
            session,
            "report.refused",
            actor=site.actor,
            study_id=study_id,
            site_id=site.site_id,
            kind=kind.value,
            round=number,
            code=exc.code,
            message=exc.message[:1000],
        )
        session.commit()
        raise
    body = report.model_dump(mode="json")
    session.add(SiteReport(study_id=study_id, site_id=site.site_id, kind=kind, round_number=number, body=body))
    audit.record(
        session,
        "report.received",
        actor=site.actor,
        study_id=study_id,
        site_id=site.site_id,
        kind=kind.value,
        round=number,
    )
    if kind is not JobKind.EXTERNAL:
        session.flush()
        complete_when_every_site_reported(session, study, now=now)
    session.commit()
    return report, True


def _admit(
    session: Session, study: Study, site: Principal, kind: JobKind, number: int, report: JobReport
) -> JobReport | None:
    """The stored report when this very one came already; else None once the study takes it now."""
    assert site.site_id is not None and site.site_name is not None
    if report.kind is not kind or report.round != number:
        raise InvalidReport(
            f"the body reports {report.kind.value} round {report.round}, the path {kind.value} round {number}",
            code="report_mismatch",
        )
    roles = job_roles(session, study.id, study.uid)
    if roles.job_of(site.site_name) is not kind:
        raise JobNotDue(f"study {study.id} gives site {site.site_name} no {kind.value} job", code="wrong_job")
    row = session.scalar(
        select(SiteReport).where(
            SiteReport.study_id == study.id,
            SiteReport.site_id == site.site_id,
            SiteReport.kind == kind,
            SiteReport.round_number == number,
        )
    )
    if row is not None:
        if row.body != report.model_dump(mode="json"):
            raise ReportConflict(f"site {site.site_name} reported {kind.value} round {number} already, otherwise")
        return stored_report(row)
    if study.id not in approved_study_ids(session, site.site_id):
        raise JobNotDue(f"site {site.site_name} has not approved study {study.id}", code="not_approved")
    taking = {StudyStatus.RUNNING, StudyStatus.COMPLETED} if kind is JobKind.EXTERNAL else {StudyStatus.RUNNING}
    if study.status not in taking:
        raise JobNotDue(f"study {study.id} is {study.status}: it takes no report", code="study_not_running")
    if kind is JobKind.EXTERNAL:
        stored = session.scalars(select(GlobalModel.round_number).where(GlobalModel.study_id == study.id)).all()
        if number not in external_rounds_due(stored, roles.every, final_round(study.status, stored, roles)):
            raise JobNotDue(
                f"study {study.id} has released no model of round {number} for validation (every "
                f"{roles.every} rounds and the final one)",
                code="round_not_due",
            )
    return None


def _check_content(terms: StudyTerms, report: JobReport) -> None:
    """InvalidReport when the report leaves the site otherwise than the terms say."""
    if report.survey is not None:
        sigma = terms.survey.noise_sigma if terms.survey is not None else None
        problem = release_problem(report.survey, min_records=terms.privacy.min_records, noise_sigma=sigma)
        if problem is not None:
            raise InvalidReport(f"survey: {problem}")
    adapting = terms.evaluation is not None and terms.evaluation.adapt_local_epochs > 0
    if report.kind is JobKind.EVALUATE and adapting != (report.adapted is not None):
        wanted = "asks for" if adapting else "asks for no"
        raise InvalidReport(f"the terms {wanted} the evaluation after adapting the local tensors (adapted)")
    for name, summary in (("evaluation", report.evaluation), ("adapted", report.adapted)):
        if summary is not None:
            _check_summary(name, summary, terms)


def _check_summary(name: str, summary: EvalSummary, terms: StudyTerms) -> None:
    """A site's exact report of a model checked as a round's `local_eval` is (shared/evaluation/summaries.py)."""
    try:
        check_reports(
            {"local_eval": summary.model_dump(mode="json")}, terms.model.config().n_classes, terms.privacy.min_records
        )
    except ValueError as exc:
        raise InvalidReport(f"{name}: {exc}") from None
