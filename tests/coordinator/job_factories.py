"""Builders for the tests of site jobs outside rounds: the studies that give them, the reports sites send."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from httpx import Response

from coordinator.db import utc_now
from coordinator.rounds.closing import tick
from shared.wire.jobs import JobKind, JobReport
from shared.wire.survey_release import release
from tests.coordinator.factories import ADMIN, approve, enrol, local_eval, running_study
from tests.shared.survey_counts import random_survey

NOISE_KEY = b"k" * 32  # reproducible survey noise


def jobs(client: TestClient, headers: dict[str, str]) -> list[dict[str, Any]]:
    """The site's due jobs."""
    response = client.get("/api/v1/jobs", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def post_report(client: TestClient, headers: dict[str, str], url: str, body: dict[str, Any]) -> Response:
    """POST a job's report to `url` (a job's report_url)."""
    return client.post(url, json=body, headers=headers)


def report_url(study_id: int, kind: str, number: int = 0) -> str:
    """The path a site reports a job of `kind` (round `number`) of a study to."""
    return f"/api/v1/studies/{study_id}/reports/{kind}/{number}"


def survey_report(seed: int = 1, *, min_records: int = 20, noise_sigma: float | None = None) -> dict[str, Any]:
    """A survey report's JSON: a random exact survey, released (noised, then suppressed) as given."""
    released = release(random_survey(seed), min_records=min_records, noise_sigma=noise_sigma, key=NOISE_KEY)
    return JobReport(kind=JobKind.SURVEY, survey=released).model_dump(mode="json")


def evaluation_report(
    kind: str, number: int = 0, *, seed: int = 1, n_samples: int = 40, adapted: bool = False
) -> dict[str, Any]:
    """An external validation's or an evaluation's report: exact figures of random predictions (clinical ones too)."""
    body: dict[str, Any] = {"kind": kind, "round": number, "evaluation": local_eval(seed, n_samples, clinical=True)}
    if adapted:
        body |= {"adapted": local_eval(seed + 100, n_samples, clinical=True), "adapt_records": 120}
    return JobReport.model_validate(body).model_dump(mode="json")


def validated_study(
    client: TestClient, sites: tuple[str, ...], validation_sites: tuple[str, ...], **changes: Any
) -> tuple[int, dict[str, dict[str, str]]]:
    """(study id, site -> headers) of a started training study whose sites and validation sites all approved it."""
    validators = {name: enrol(client, name) for name in validation_sites}
    study_id, headers = running_study(client, sites, validation_sites=list(validation_sites), **changes)
    for site_headers in validators.values():
        approve(client, site_headers, study_id)
    return study_id, {**headers, **validators}


def study_json(client: TestClient, study_id: int) -> dict[str, Any]:
    """The study as researchers read it."""
    response = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def tick_after(client: TestClient, seconds: float) -> None:
    """Run the deadline tick as if `seconds` had passed."""
    state = client.app.state.coordinator
    tick(state.sessions, now=utc_now() + timedelta(seconds=seconds), lease_s=state.settings.aggregation_lease_s)
