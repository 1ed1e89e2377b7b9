"""Site jobs outside rounds: a site's due jobs and its reports; what researchers read of them per kind of study."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from coordinator.api.deps import Caller, Id, SessionDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.studies import lifecycle as studies
from coordinator.studies.job_results import evaluation_results, external_results, survey_results
from coordinator.studies.jobs import due_jobs
from coordinator.studies.reports import accept_report
from shared.wire.jobs import EvaluationResults, ExternalResults, JobKind, JobReport, SiteJob, SurveyResults

router = APIRouter(tags=["site jobs"], route_class=SessionReleasingRoute)


@router.get("/jobs", responses={200: {"model": list[SiteJob]}})
def read_jobs(site: Caller, session: SessionDep) -> JSONResponse:
    """The calling site's due jobs outside rounds (surveys, evaluations, models to validate), oldest study first."""
    return JSONResponse([job.model_dump(mode="json") for job in due_jobs(session, site)])


@router.post(
    "/studies/{study_id}/reports/{kind}/{number}",
    status_code=201,
    responses={
        201: {"model": JobReport, "description": "the report is stored: it, as stored"},
        200: {"model": JobReport, "description": "the same report again: the stored one"},
    },
)
def post_report(
    study_id: Id, kind: JobKind, number: Id, body: JobReport, site: Caller, session: SessionDep
) -> JSONResponse:
    """Store the site's report of its job `kind` (`number`: the validated round t, else 0); 201 new, 200 repeated."""
    report, created = accept_report(
        session, study_id=study_id, site=site, kind=kind, number=number, report=body, now=utc_now()
    )
    return JSONResponse(report.model_dump(mode="json"), status_code=201 if created else 200)


@router.get("/studies/{study_id}/survey")
def read_survey(study_id: Id, session: SessionDep) -> SurveyResults:
    """A survey study's released surveys, in the terms' site order, and the sites it awaits."""
    return survey_results(session, studies.get_study(session, study_id))


@router.get("/studies/{study_id}/external")
def read_external(study_id: Id, session: SessionDep) -> ExternalResults:
    """A training study's validation sites' evaluations of its released models, apart from its training sites'."""
    return external_results(session, studies.get_study(session, study_id))


@router.get("/studies/{study_id}/evaluations")
def read_evaluations(study_id: Id, session: SessionDep) -> EvaluationResults:
    """An evaluate study's per-site evaluations of the model it names, and the sites it awaits."""
    return evaluation_results(session, studies.get_study(session, study_id))
