"""The answers of GET /studies/{id}/survey|external|evaluations for client, CLI and dashboard tests, with known values.

Surveys are released by `shared.wire.survey_release.release` (min_records 10) from exact surveys of
`tests/shared/survey_counts.survey_with`; evaluations are sites' exact reports (`local_eval`, clinical).
`mock_coordinator` answers the researcher's reads of three studies from them over an httpx.MockTransport.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import httpx
from pydantic import BaseModel

from shared.study.survey import survey_epsilon
from shared.terms import StudyTerms
from shared.wire.api import Page, RoundPublic, StudyPublic
from shared.wire.jobs import (
    EvaluationResult,
    EvaluationResults,
    ExternalResult,
    ExternalResults,
    ReportedSurvey,
    SurveyResults,
)
from shared.wire.protocol import EvalSummary
from shared.wire.survey import SiteSurvey
from shared.wire.survey_release import release
from tests.coordinator.factories import local_eval
from tests.shared.survey_counts import survey_with

AT = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
MIN_RECORDS = 10
TRAIN, SURVEY, EVALUATE = 1, 2, 3  # the study ids `mock_coordinator` serves
EVALUATED_UID = "ab" * 16
MODEL_SHA = "c" * 64

# lyon: 120 train (NORM 60, AFIB 15), 40 test (NORM 20, AFIB 3: below 10, hidden), 7 excluded (hidden whole);
# oslo: 80 train (NORM 30, AFIB 20), 30 test (NORM 10, AFIB 12), 12 excluded (NORM 0: a patient table's 0, hidden).
EXACT = {
    "lyon": survey_with(
        {"train": 120, "test": 40, "excluded": 7},
        train__labels__NORM=60,
        train__labels__AFIB=15,
        test__labels__NORM=20,
        test__labels__AFIB=3,
        train__quality__flat_lead=12,
    ),
    "oslo": survey_with(
        {"train": 80, "test": 30, "excluded": 12},
        train__labels__NORM=30,
        train__labels__AFIB=20,
        test__labels__NORM=10,
        test__labels__AFIB=12,
        train__quality__flat_lead=0,
    ),
}


def released(site: str) -> SiteSurvey:
    """A site's survey as it leaves the site: suppressed below MIN_RECORDS, no noise."""
    return release(EXACT[site], min_records=MIN_RECORDS)


def survey_results(*, noise_sigma: float | None = None, awaiting: tuple[str, ...] = ("riga",)) -> SurveyResults:
    """The released surveys of lyon and oslo; riga awaited. With `noise_sigma` the answer says so (the counts stay)."""
    delta = 1e-6
    return SurveyResults(
        study_id=SURVEY,
        min_records=MIN_RECORDS,
        noise_sigma=noise_sigma,
        epsilon=survey_epsilon(noise_sigma, delta) if noise_sigma else None,
        delta=delta if noise_sigma else None,
        sites=[ReportedSurvey(site=site, survey=released(site), received_at=AT) for site in ("lyon", "oslo")],
        awaiting=list(awaiting),
    )


def evaluation(seed: int, n_samples: int = 40) -> EvalSummary:
    """A site's exact report of a model with every clinical figure and its bootstrap interval."""
    return EvalSummary.model_validate(local_eval(seed, n_samples=n_samples, clinical=True))


def external_results() -> ExternalResults:
    """Sites graz and riga validate every 2nd model of 4: both theta^g_2, graz alone theta^g_4 (final) so far."""
    results = [
        ExternalResult(site="graz", round=2, evaluation=evaluation(1, 50), received_at=AT),
        ExternalResult(site="riga", round=2, evaluation=evaluation(2, 70), received_at=AT),
        ExternalResult(site="graz", round=4, evaluation=evaluation(3, 50), received_at=AT),
    ]
    return ExternalResults(study_id=TRAIN, validation_sites=["graz", "riga"], every=2, final_round=4, results=results)


def evaluation_results() -> EvaluationResults:
    """Site lyon adapted its local tensors (2 epochs on 120 records); oslo evaluated only; riga awaited."""
    return EvaluationResults(
        study_id=EVALUATE,
        evaluated_study_uid=EVALUATED_UID,
        model_sha256=MODEL_SHA,
        adapt_local_epochs=2,
        results=[
            EvaluationResult(
                site="lyon", evaluation=evaluation(4), adapted=evaluation(5), adapt_records=120, received_at=AT
            ),
            EvaluationResult(site="oslo", evaluation=evaluation(6, 30), received_at=AT),
        ],
        awaiting=["riga"],
    )


def study(study_id: int, status: str = "completed") -> StudyPublic:
    """The study of that id: a training study with validation sites, a survey study or an evaluate study."""
    sites = ["lyon", "oslo"]
    terms = {
        TRAIN: StudyTerms(sites=sites, validation_sites=["graz", "riga"], validation_every=2, rounds=4),
        SURVEY: StudyTerms(sites=[*sites, "riga"], kind="survey"),
        EVALUATE: StudyTerms(
            sites=[*sites, "riga"],
            kind="evaluate",
            evaluation={"study_uid": EVALUATED_UID, "model_sha256": MODEL_SHA, "adapt_local_epochs": 2},
        ),
    }[study_id]
    return StudyPublic(
        id=study_id,
        uid=f"{study_id:032x}",
        name={TRAIN: "trial", SURVEY: "readiness", EVALUATE: "transfer"}[study_id],
        status=status,
        config=terms,
        created_by="admin",
        created_at=AT,
        updated_at=AT,
        completed_rounds=4 if study_id == TRAIN else 0,
        current_round=None,
        latest_global_sha256=None,
    )


def train_round(number: int = 4) -> RoundPublic:
    """A completed round of the training study, with its theta^g_t's pooled reading over the training sites."""
    return RoundPublic.model_validate(
        {
            **{"id": number, "study_id": TRAIN, "number": number, "attempt": 1, "kind": "train", "status": "completed"},
            **{"participants": {"lyon": 1.0, "oslo": 1.0}, "opened_at": AT, "deadline_at": AT, "closed_at": AT},
            **{"note": "", "base_sha256": "0" * 64, "base_size": 10, "global_model_sha256": "1" * 64},
            "updates": [],
            "pooled": {"train_loss": 0.5, "eval": {"micro_f1": 0.612, "map": 0.433, "n_samples": 70}},
        }
    )


def _json(model: BaseModel) -> httpx.Response:
    return httpx.Response(200, content=model.model_dump_json(), headers={"content-type": "application/json"})


def answers() -> dict[str, BaseModel]:
    """The coordinator's answer to each read of the three studies, by path."""
    studies = [study(i) for i in (TRAIN, SURVEY, EVALUATE)]
    return {
        "/api/v1/studies": Page[StudyPublic](data=studies, count=len(studies)),
        **{f"/api/v1/studies/{s.id}": s for s in studies},
        f"/api/v1/studies/{TRAIN}/rounds": Page[RoundPublic](data=[train_round()], count=1),
        f"/api/v1/studies/{TRAIN}/rounds/3": train_round(3),
        f"/api/v1/studies/{SURVEY}/rounds": Page[RoundPublic](data=[], count=0),
        f"/api/v1/studies/{EVALUATE}/rounds": Page[RoundPublic](data=[], count=0),
        f"/api/v1/studies/{TRAIN}/external": external_results(),
        f"/api/v1/studies/{SURVEY}/survey": survey_results(),
        f"/api/v1/studies/{EVALUATE}/evaluations": evaluation_results(),
    }


def mock_coordinator(requests: list[str] | None = None) -> httpx.Client:
    """An httpx client whose transport answers the reads of the three studies (a 404 for anything else)."""
    known = answers()

    def answer(request: httpx.Request) -> httpx.Response:
        if requests is not None:
            requests.append(request.url.path)
        found = known.get(request.url.path)
        if found is None:
            body = {"error": {"code": "not_found", "message": f"no {request.url.path}"}}
            return httpx.Response(404, content=json.dumps(body), headers={"content-type": "application/json"})
        return _json(found)

    return httpx.Client(transport=httpx.MockTransport(answer), base_url="http://coordinator.test")
