"""Site jobs: the work of a study that is not a training round, as it crosses the network.

Three kinds, each one job per site (per released model for external validation), none part of a
round, so none enters K, the quorum, the weights or a secure setup:

- `survey`: a survey study's site releases its data-readiness survey once (shared/wire/survey.py).
- `external`: a validation site of a training study (StudyTerms.validation_sites) evaluates a released
  theta^g_t, as the study's global evaluation model (theta^g with phi_0), on all its records.
- `evaluate`: a site of an evaluate study evaluates the model the terms name (StudyTerms.evaluation),
  before and, with `adapt_local_epochs`, after training its local tensors on its own training split.

The coordinator lists a site's due jobs (`jobs_url`); the site checks each against the terms its
operator approved and the digests in them, and POSTs a `JobReport` to the job's `report_url`.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field, model_validator

from shared.errors import MetricsError
from shared.terms import StudyTerms
from shared.wire.protocol import EvalSummary, _Input, _Output
from shared.wire.survey import SiteSurvey
from shared.wire.urls import API

__all__ = [
    "EvaluationResult",
    "EvaluationResults",
    "ExternalResult",
    "ExternalResults",
    "JobKind",
    "JobReport",
    "ReportedSurvey",
    "SiteJob",
    "SurveyResults",
    "jobs_url",
    "report_url",
]


class JobKind(StrEnum):
    """What a site job asks for."""

    SURVEY = "survey"
    EXTERNAL = "external"
    EVALUATE = "evaluate"


def jobs_url() -> str:
    """GET (a site): its due jobs, oldest study first."""
    return f"{API}/jobs"


def report_url(study_id: int, kind: JobKind, round_number: int = 0) -> str:
    """POST (a site): its report of a job; `round_number` the evaluated theta^g_t's t (external), else 0."""
    return f"{API}/studies/{study_id}/reports/{kind.value}/{round_number}"


class SiteJob(_Output):
    """One due job of a site: the study's terms whole, what to download, where to report.

    `model_*` are theta^g_t (external: the released round `round`; evaluate: the evaluated study's
    final model, whose digest the terms name) and `initial_local_*` phi_0 beside it; a survey has neither.
    """

    protocol: int
    study_id: int
    study_uid: str = Field(pattern=r"^[0-9a-f]{32}$")
    site: str
    terms: StudyTerms
    kind: JobKind
    round: int = 0  # external: t of theta^g_t; else 0
    model_url: str | None = None
    model_sha256: str | None = None
    initial_local_url: str | None = None
    initial_local_sha256: str | None = None
    report_url: str


class JobReport(_Input):
    """What a site sends for a job: its released survey, or its evaluation (and, adapted, the one after)."""

    kind: JobKind
    round: int = Field(0, ge=0)
    survey: SiteSurvey | None = None  # survey: released as the terms say (survey_release.release_problem)
    evaluation: EvalSummary | None = None  # external, evaluate: the model as released, on the site's records
    adapted: EvalSummary | None = None  # evaluate with adapt_local_epochs: after training phi on its own records
    adapt_records: int | None = Field(None, ge=1)  # evaluate adapted: the training records phi was adapted on

    @model_validator(mode="after")
    def _parts_of_kind(self) -> JobReport:
        if (self.survey is not None) != (self.kind is JobKind.SURVEY):
            raise MetricsError(f"a {self.kind.value} report carries a survey exactly when it is a survey's")
        if self.kind is not JobKind.SURVEY and self.evaluation is None:
            raise MetricsError(f"a {self.kind.value} report carries the evaluation")
        if self.adapted is not None and self.kind is not JobKind.EVALUATE:
            raise MetricsError("only an evaluate study's report carries an adapted model's evaluation")
        if (self.adapted is None) != (self.adapt_records is None):
            raise MetricsError("an adapted evaluation names the records it adapted on, and only it")
        if self.round and self.kind is not JobKind.EXTERNAL:
            raise MetricsError("only an external validation names a round")
        return self


class ReportedSurvey(_Output):
    """One site's released survey, as the coordinator stored it."""

    site: str
    survey: SiteSurvey
    received_at: datetime


class SurveyResults(_Output):
    """GET /studies/{id}/survey: each reporting site's released survey (in the terms' site order), who is awaited."""

    study_id: int
    min_records: int  # counts below it were suppressed
    noise_sigma: float | None = None  # the noise on every count, when the terms asked for it
    epsilon: float | None = None  # what that noise spent, at `delta`
    delta: float | None = None
    sites: list[ReportedSurvey]
    awaiting: list[str]  # listed sites that have not reported yet


class ExternalResult(_Output):
    """One validation site's evaluation of theta^g_t on all its records."""

    site: str
    round: int
    evaluation: EvalSummary
    received_at: datetime


class ExternalResults(_Output):
    """GET /studies/{id}/external: every validation site's evaluations by round and site, apart from training sites'."""

    study_id: int
    validation_sites: list[str]
    every: int  # the terms' validation_every
    final_round: int | None = None  # T, once the study completed: its theta^g_T is evaluated too
    results: list[ExternalResult]


class EvaluationResult(_Output):
    """One site's evaluation of the named model: as released, and after adapting phi when the terms ask."""

    site: str
    evaluation: EvalSummary
    adapted: EvalSummary | None = None
    adapt_records: int | None = None
    received_at: datetime


class EvaluationResults(_Output):
    """GET /studies/{id}/evaluations: an evaluate study's per-site results (in the terms' site order)."""

    study_id: int
    evaluated_study_uid: str | None = None  # None: a model file, which the terms name by its digests alone
    model_sha256: str
    adapt_local_epochs: int
    results: list[EvaluationResult]
    awaiting: list[str]
