"""What sites reported of their jobs outside rounds, as researchers read it: surveys, validations, evaluations.

Each view is of one kind of study (409 wrong_study_kind for another): a survey study's released
surveys, a training study's validation sites' evaluations of its released models, an evaluate study's
evaluations of the model it names. Sites are shown in the terms' order; `awaiting` are those still due.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.errors import WrongStudyKind
from coordinator.models import GlobalModel, Site, SiteReport, Study, StudyStatus
from coordinator.studies.reports import stored_report
from shared.study.survey import survey_epsilon
from shared.terms import StudyKind
from shared.wire.jobs import (
    EvaluationResult,
    EvaluationResults,
    ExternalResult,
    ExternalResults,
    JobReport,
    ReportedSurvey,
    SurveyResults,
)

__all__ = ["evaluation_results", "external_results", "survey_results"]

Reported = tuple[str, JobReport, SiteReport]  # (site, its report, the stored row)


def _reports(session: Session, study: Study, kind: StudyKind, sites: list[str]) -> list[Reported]:
    """The study's reports in the order of `sites`, then of rounds; WrongStudyKind unless the study is of `kind`."""
    if study.terms.kind != kind:
        raise WrongStudyKind(f"study {study.id} is a {study.terms.kind} study, not a {kind} study")
    rows = session.execute(
        select(Site.name, SiteReport).join(Site, SiteReport.site_id == Site.id).where(SiteReport.study_id == study.id)
    ).all()
    order = {site: index for index, site in enumerate(sites)}
    ordered = sorted(rows, key=lambda row: (row[1].round_number, order.get(row[0], len(order)), row[0]))
    return [(name, stored_report(row), row) for name, row in ordered]


def _awaiting(sites: list[str], reported: list[Reported]) -> list[str]:
    """The sites of `sites` without a report."""
    done = {site for site, _, _ in reported}
    return [site for site in sites if site not in done]


def survey_results(session: Session, study: Study) -> SurveyResults:
    """A survey study's released surveys, and the sites it still awaits."""
    terms = study.terms
    reported = _reports(session, study, "survey", terms.sites)
    sigma = terms.survey.noise_sigma if terms.survey is not None else None
    delta = terms.survey.delta if terms.survey is not None and sigma is not None else None
    return SurveyResults(
        study_id=study.id,
        min_records=terms.privacy.min_records,
        noise_sigma=sigma,
        epsilon=survey_epsilon(sigma, delta) if sigma is not None and delta is not None else None,
        delta=delta,
        sites=[
            ReportedSurvey(site=site, survey=report.survey, received_at=row.received_at)
            for site, report, row in reported
            if report.survey is not None
        ],
        awaiting=_awaiting(terms.sites, reported),
    )


def external_results(session: Session, study: Study) -> ExternalResults:
    """A training study's validation sites' evaluations of its released models, by round then site."""
    terms = study.terms
    reported = _reports(session, study, "train", terms.validation_sites)
    final = None
    if study.status == StudyStatus.COMPLETED:
        final = session.scalar(
            select(GlobalModel.round_number)
            .where(GlobalModel.study_id == study.id)
            .order_by(GlobalModel.round_number.desc())
            .limit(1)
        )
    return ExternalResults(
        study_id=study.id,
        validation_sites=terms.validation_sites,
        every=terms.validation_every,
        final_round=final,
        results=[
            ExternalResult(site=site, round=report.round, evaluation=report.evaluation, received_at=row.received_at)
            for site, report, row in reported
            if report.evaluation is not None
        ],
    )


def evaluation_results(session: Session, study: Study) -> EvaluationResults:
    """An evaluate study's per-site evaluations of the model it names, and the sites it still awaits."""
    terms = study.terms
    reported = _reports(session, study, "evaluate", terms.sites)
    assert terms.evaluation is not None and terms.evaluation.model_sha256 is not None  # filled at creation
    return EvaluationResults(
        study_id=study.id,
        evaluated_study_uid=terms.evaluation.study_uid,
        model_sha256=terms.evaluation.model_sha256,
        adapt_local_epochs=terms.evaluation.adapt_local_epochs,
        results=[
            EvaluationResult(
                site=site,
                evaluation=report.evaluation,
                adapted=report.adapted,
                adapt_records=report.adapt_records,
                received_at=row.received_at,
            )
            for site, report, row in reported
            if report.evaluation is not None
        ],
        awaiting=_awaiting(terms.sites, reported),
    )
