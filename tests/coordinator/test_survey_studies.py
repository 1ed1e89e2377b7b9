"""Survey studies: no model, no round; each site reports its released survey once; done when all did, or at deadline.

Tests taking `client` run on SQLite and on PostgreSQL (tests/coordinator/conftest.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import utc_now
from coordinator.models import Role, Site
from coordinator.sites.security import Principal
from coordinator.studies.reports import accept_report
from shared.study.survey import survey_epsilon
from shared.wire.jobs import JobKind, JobReport
from tests.coordinator.factories import ADMIN, approve, create_study, enrol, running_study
from tests.coordinator.job_factories import (
    evaluation_report,
    jobs,
    post_report,
    report_url,
    study_json,
    survey_report,
    tick_after,
)
from tests.shared.survey_counts import random_survey


def _results(client: TestClient, study_id: int) -> dict[str, Any]:
    response = client.get(f"/api/v1/studies/{study_id}/survey", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def _error(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_a_survey_study_starts_without_a_model_or_a_round_and_lists_each_site_its_job(client: TestClient) -> None:
    study_id, headers = running_study(client, ("oslo", "lyon"), kind="survey")
    study = study_json(client, study_id)
    assert (study["status"], study["current_round"], study["latest_global_sha256"]) == ("running", None, None)
    assert client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["count"] == 0
    assert client.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()["count"] == 0
    (job,) = jobs(client, headers["lyon"])
    assert {key: job[key] for key in ("study_id", "site", "kind", "round", "model_url", "initial_local_url")} == {
        "study_id": study_id,
        "site": "lyon",
        "kind": "survey",
        "round": 0,
        "model_url": None,
        "initial_local_url": None,
    }
    assert job["report_url"] == report_url(study_id, "survey")
    assert job["terms"]["kind"] == "survey" and job["terms"]["sites"] == ["oslo", "lyon"]
    assert client.get("/api/v1/tasks/next", headers=headers["lyon"]).status_code == 204


def test_the_study_completes_when_every_site_reported_and_shows_them_in_the_terms_order(client: TestClient) -> None:
    study_id, headers = running_study(client, ("oslo", "lyon"), kind="survey")
    url = report_url(study_id, "survey")
    first = post_report(client, headers["lyon"], url, survey_report(1))
    assert first.status_code == 201, first.text
    assert first.json() == survey_report(1)
    assert jobs(client, headers["lyon"]) == [] and len(jobs(client, headers["oslo"])) == 1
    halfway = _results(client, study_id)
    assert ([s["site"] for s in halfway["sites"]], halfway["awaiting"]) == (["lyon"], ["oslo"])
    assert study_json(client, study_id)["status"] == "running"
    assert post_report(client, headers["oslo"], url, survey_report(2)).status_code == 201
    assert study_json(client, study_id)["status"] == "completed"
    results = _results(client, study_id)
    assert [s["site"] for s in results["sites"]] == ["oslo", "lyon"] and results["awaiting"] == []
    assert results["sites"][1]["survey"] == survey_report(1)["survey"]
    released = (results["min_records"], results["noise_sigma"], results["epsilon"], results["delta"])
    assert released == (20, None, None, None)
    actions = [e["action"] for e in client.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]]
    assert actions.count("report.received") == 2 and actions[-1] == "study.completed"


def test_the_same_report_again_is_answered_with_the_stored_one_and_another_is_a_conflict(client: TestClient) -> None:
    study_id, headers = running_study(client, ("oslo", "lyon"), kind="survey")
    url = report_url(study_id, "survey")
    assert post_report(client, headers["lyon"], url, survey_report(1)).status_code == 201
    again = post_report(client, headers["lyon"], url, survey_report(1))
    assert (again.status_code, again.json()) == (200, survey_report(1))
    assert _error(post_report(client, headers["lyon"], url, survey_report(2))) == (409, "report_conflict")
    assert _results(client, study_id)["sites"][0]["survey"] == survey_report(1)["survey"]


def test_a_noised_survey_shows_the_epsilon_its_noise_spent(client: TestClient) -> None:
    study_id, headers = running_study(client, ("lyon",), kind="survey", survey={"noise_sigma": 3.0, "delta": 1e-7})
    url = report_url(study_id, "survey")
    assert _error(post_report(client, headers["lyon"], url, survey_report(1))) == (422, "invalid_report")
    assert post_report(client, headers["lyon"], url, survey_report(1, noise_sigma=3.0)).status_code == 201
    results = _results(client, study_id)
    assert (results["noise_sigma"], results["delta"]) == (3.0, 1e-7)
    assert results["epsilon"] == pytest.approx(survey_epsilon(3.0, 1e-7))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (survey_report(1, min_records=10), "suppressed below 10 records, the terms say 20"),
        ({"kind": "survey", "survey": random_survey(1).model_dump(mode="json")}, "was not suppressed"),
        (survey_report(1, noise_sigma=1.0), "noise sigma is 1.0, the terms say None"),
    ],
    ids=["other threshold", "exact", "noised"],
)
def test_a_survey_not_released_as_the_terms_say_is_refused_and_not_stored(
    client: TestClient, body: dict[str, Any], message: str
) -> None:
    study_id, headers = running_study(client, ("lyon",), kind="survey")
    refused = post_report(client, headers["lyon"], report_url(study_id, "survey"), body)
    assert _error(refused) == (422, "invalid_report") and message in refused.json()["error"]["message"]
    assert _results(client, study_id)["awaiting"] == ["lyon"] and len(jobs(client, headers["lyon"])) == 1
    events = client.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    assert events[-1]["action"] == "report.refused" and events[-1]["detail"]["code"] == "invalid_report"


def test_a_report_whose_body_is_not_the_paths_or_not_the_sites_job_is_refused(client: TestClient) -> None:
    study_id, headers = running_study(client, ("lyon",), kind="survey")
    report = survey_report(1)
    mismatched = post_report(client, headers["lyon"], report_url(study_id, "evaluate"), report)
    assert _error(mismatched) == (422, "report_mismatch")
    external = evaluation_report("external")
    assert _error(post_report(client, headers["lyon"], report_url(study_id, "external"), external)) == (
        409,
        "wrong_job",
    )
    graz = enrol(client, "graz")  # listed nowhere: told as for a study that does not exist
    other = post_report(client, graz, report_url(study_id, "survey"), report)
    missing = post_report(client, graz, report_url(999, "survey"), report)
    assert _error(other) == _error(missing) == (403, "not_a_participant")
    trained, trained_headers = running_study(client, ("rome",))
    to_training = post_report(client, trained_headers["rome"], report_url(trained, "survey"), report)
    assert _error(to_training) == (409, "wrong_job")


def test_a_site_that_has_not_approved_gets_no_job_and_its_report_is_refused(client: TestClient) -> None:
    study_id, headers = running_study(client, ("lyon",), kind="survey", approved=False)
    assert jobs(client, headers["lyon"]) == []
    refused = post_report(client, headers["lyon"], report_url(study_id, "survey"), survey_report(1))
    assert _error(refused) == (409, "not_approved")


def test_a_paused_survey_lists_no_job_and_takes_no_report_until_resumed(client: TestClient) -> None:
    study_id, headers = running_study(client, ("lyon",), kind="survey")
    assert client.post(f"/api/v1/studies/{study_id}/pause", headers=ADMIN).status_code == 200
    assert jobs(client, headers["lyon"]) == []
    url = report_url(study_id, "survey")
    assert _error(post_report(client, headers["lyon"], url, survey_report(1))) == (409, "study_not_running")
    resumed = client.post(f"/api/v1/studies/{study_id}/resume", headers=ADMIN)
    assert resumed.status_code == 200 and resumed.json()["current_round"] is None
    assert client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["count"] == 0
    assert len(jobs(client, headers["lyon"])) == 1
    assert post_report(client, headers["lyon"], url, survey_report(1)).status_code == 201
    assert study_json(client, study_id)["status"] == "completed"


def test_a_cancelled_survey_lists_no_job_and_takes_no_report(client: TestClient) -> None:
    study_id, headers = running_study(client, ("lyon",), kind="survey")
    assert client.post(f"/api/v1/studies/{study_id}/cancel", headers=ADMIN).status_code == 200
    assert jobs(client, headers["lyon"]) == []
    refused = post_report(client, headers["lyon"], report_url(study_id, "survey"), survey_report(1))
    assert _error(refused) == (409, "study_not_running")
    assert _results(client, study_id)["sites"] == []


def test_at_the_deadline_a_survey_with_quorum_completes(client: TestClient) -> None:
    study_id, headers = running_study(client, ("oslo", "lyon", "rome"), kind="survey", min_sites=2)
    url = report_url(study_id, "survey")
    for site in ("oslo", "rome"):
        assert post_report(client, headers[site], url, survey_report(3)).status_code == 201
    tick_after(client, 30.0)  # before the 60 s deadline: nothing happens
    assert study_json(client, study_id)["status"] == "running"
    tick_after(client, 61.0)
    assert study_json(client, study_id)["status"] == "completed"
    assert _results(client, study_id)["awaiting"] == ["lyon"]
    assert jobs(client, headers["lyon"]) == []
    assert _error(post_report(client, headers["lyon"], url, survey_report(3))) == (409, "study_not_running")


def test_at_the_deadline_a_survey_below_quorum_fails_and_says_why(client: TestClient) -> None:
    study_id, headers = running_study(client, ("oslo", "lyon", "rome"), kind="survey", min_sites=2)
    assert post_report(client, headers["oslo"], report_url(study_id, "survey"), survey_report(3)).status_code == 201
    tick_after(client, 61.0)
    assert study_json(client, study_id)["status"] == "failed"
    event = client.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"][-1]
    assert event["action"] == "study.failed"
    assert event["detail"] == {"reported": 1, "reason": "deadline: 1 of 3 sites reported, min_sites is 2"}


def test_the_survey_view_refuses_a_study_of_another_kind_and_an_unknown_study(client: TestClient) -> None:
    trained, _ = running_study(client, ("lyon",))
    wrong = client.get(f"/api/v1/studies/{trained}/survey", headers=ADMIN)
    assert _error(wrong) == (409, "wrong_study_kind") and "a train study" in wrong.json()["error"]["message"]
    assert _error(client.get("/api/v1/studies/999/survey", headers=ADMIN)) == (404, "not_found")


def test_a_sites_jobs_of_several_studies_come_oldest_study_first(client: TestClient) -> None:
    lyon = enrol(client, "lyon")
    studies = [create_study(client, ["lyon"], kind="survey") for _ in range(3)]
    for study_id in studies:
        approve(client, lyon, study_id)
        assert client.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    assert post_report(client, lyon, report_url(studies[1], "survey"), survey_report(1)).status_code == 201
    assert [job["study_id"] for job in jobs(client, lyon)] == [studies[0], studies[2]]


def test_the_last_two_reports_arriving_together_complete_the_study(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    """Each report locks the study's row until it commits, so the later one counts the earlier (on PostgreSQL too)."""
    study_id, _ = running_study(client, ("oslo", "lyon"), kind="survey")
    with sessions() as session:
        site_ids = dict(session.execute(select(Site.name, Site.id)).all())
    together = threading.Barrier(2)

    def send(name: str) -> bool:
        site = Principal(role=Role.SITE, actor=f"site:{name}", site_id=site_ids[name], site_name=name)
        report = JobReport.model_validate(survey_report(len(name)))
        together.wait()
        with sessions() as session:
            _, created = accept_report(
                session, study_id=study_id, site=site, kind=JobKind.SURVEY, number=0, report=report, now=utc_now()
            )
        return created

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(send, ["oslo", "lyon"])) == [True, True]
    assert study_json(client, study_id)["status"] == "completed"
