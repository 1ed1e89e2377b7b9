"""Validation sites of a training study: never in a round; each validates every validation_every-th model and T.

Tests taking `client` run on SQLite and on PostgreSQL (tests/coordinator/conftest.py).
"""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from fastapi.testclient import TestClient

from coordinator.studies.jobs import JobRoles, external_rounds_due, final_round
from shared.terms import StudyTerms
from shared.wire.jobs import JobKind
from tests.coordinator.factories import (
    ADMIN,
    approve,
    create_study,
    download,
    enrol,
    evaluate_and_upload,
    next_task,
    running_study,
    shifted,
    train_and_upload,
    update_body,
    upload,
)
from tests.coordinator.job_factories import (
    evaluation_report,
    jobs,
    post_report,
    report_url,
    study_json,
    validated_study,
)


def _error(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def _models(client: TestClient, study_id: int) -> dict[int, dict[str, Any]]:
    listed = client.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()["data"]
    return {model["round"]: model for model in listed}


def _train(client: TestClient, headers: dict[str, str]) -> None:
    """One round of the single training site (its update completes the round)."""
    assert train_and_upload(client, headers, 0.5, 10).status_code == 201


def _external(client: TestClient, study_id: int) -> dict[str, Any]:
    response = client.get(f"/api/v1/studies/{study_id}/external", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_validation_site_gets_no_task_and_its_update_is_refused(client: TestClient) -> None:
    study_id, headers = validated_study(client, ("lyon", "oslo"), ("graz",))
    (round_,) = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert sorted(round_["participants"]) == ["lyon", "oslo"]
    assert client.get("/api/v1/tasks/next", headers=headers["graz"]).status_code == 204
    task = next_task(client, headers["lyon"])
    base = download(client, task["global_model_url"], headers["graz"])  # a listed site may read the models
    refused = upload(client, task, headers["graz"], update_body(shifted(base, 1.0), 10))
    assert _error(refused) == (403, "not_a_participant")
    assert train_and_upload(client, headers["lyon"], 1.0, 10).status_code == 201
    assert train_and_upload(client, headers["oslo"], 3.0, 30).status_code == 201
    done = client.get(f"/api/v1/studies/{study_id}/rounds/1", headers=ADMIN).json()
    assert done["status"] == "completed"
    assert {u["site"]: u["weight"] for u in done["updates"]} == {"lyon": 0.25, "oslo": 0.75}


def test_a_secure_studys_validation_site_needs_no_signing_key_and_is_outside_the_round(client: TestClient) -> None:
    headers = {name: enrol(client, name) for name in ("lyon", "oslo", "graz")}
    for name in ("lyon", "oslo"):
        public = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        response = client.put("/api/v1/sites/me/signing-key", json={"public_key": public.hex()}, headers=headers[name])
        assert response.status_code == 204, response.text
    secure = {"min_records": 1, "secure_aggregation": {"phase_timeout_s": 30}}
    study_id = create_study(client, ["lyon", "oslo"], validation_sites=["graz"], min_sites=2, privacy=secure)
    keys = study_json(client, study_id)["config"]["privacy"]["secure_aggregation"]["site_keys"]
    assert sorted(keys) == ["lyon", "oslo"]
    for site_headers in headers.values():
        approve(client, site_headers, study_id)
    assert client.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    (round_,) = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert sorted(round_["participants"]) == ["lyon", "oslo"]
    secagg = client.get(f"/api/v1/rounds/{round_['id']}/secagg", headers=headers["graz"])
    assert _error(secagg) == (403, "not_a_participant")


def test_a_validation_site_is_due_every_nth_released_model_and_the_final_one(client: TestClient) -> None:
    study_id, headers = validated_study(client, ("lyon",), ("graz",), rounds=3, validation_every=2)
    graz, lyon = headers["graz"], headers["lyon"]
    assert jobs(client, graz) == []
    _train(client, lyon)  # theta^g_1: not due (1 is no multiple of 2, nor T = 3)
    assert jobs(client, graz) == []
    _train(client, lyon)  # theta^g_2
    (job,) = jobs(client, graz)
    models = _models(client, study_id)
    assert {key: job[key] for key in ("site", "kind", "round", "model_url", "model_sha256", "report_url")} == {
        "site": "graz",
        "kind": "external",
        "round": 2,
        "model_url": f"/api/v1/studies/{study_id}/models/2",
        "model_sha256": models[2]["sha256"],
        "report_url": report_url(study_id, "external", 2),
    }
    assert job["initial_local_url"] == f"/api/v1/studies/{study_id}/models/0/local"
    assert job["initial_local_sha256"] == models[0]["local_sha256"]
    assert job["terms"]["validation_sites"] == ["graz"] and job["terms"]["validation_every"] == 2
    for number in (1, 3):  # not due; not released yet
        refused = post_report(
            client, graz, report_url(study_id, "external", number), evaluation_report("external", number)
        )
        assert _error(refused) == (409, "round_not_due"), number
    _train(client, lyon)  # theta^g_3 = theta^g_T: due, though 3 is no multiple of 2
    assert [job["round"] for job in jobs(client, graz)] == [2, 3]
    assert (
        post_report(client, graz, report_url(study_id, "external", 2), evaluation_report("external", 2)).status_code
        == 201
    )
    assert [job["round"] for job in jobs(client, graz)] == [3]
    assert _external(client, study_id)["final_round"] is None  # not completed yet
    assert evaluate_and_upload(client, lyon).status_code == 201
    assert study_json(client, study_id)["status"] == "completed"
    assert [job["round"] for job in jobs(client, graz)] == [3]  # a completed study still takes its final validation
    body = evaluation_report("external", 3, seed=5)
    assert post_report(client, graz, report_url(study_id, "external", 3), body).status_code == 201
    assert jobs(client, graz) == [] and jobs(client, lyon) == []
    results = _external(client, study_id)
    assert (results["validation_sites"], results["every"], results["final_round"]) == (["graz"], 2, 3)
    assert [(r["site"], r["round"]) for r in results["results"]] == [("graz", 2), ("graz", 3)]
    assert results["results"][1]["evaluation"] == body["evaluation"]


def test_a_training_site_has_no_external_job_and_may_not_report_one(client: TestClient) -> None:
    study_id, headers = validated_study(client, ("lyon",), ("graz",), rounds=2)
    _train(client, headers["lyon"])
    assert jobs(client, headers["lyon"]) == [] and [job["round"] for job in jobs(client, headers["graz"])] == [1]
    refused = post_report(
        client, headers["lyon"], report_url(study_id, "external", 1), evaluation_report("external", 1)
    )
    assert _error(refused) == (409, "wrong_job")


def test_an_external_report_is_checked_as_a_rounds_figures_and_is_idempotent(client: TestClient) -> None:
    study_id, headers = validated_study(client, ("lyon",), ("graz",), rounds=2)
    _train(client, headers["lyon"])
    url = report_url(study_id, "external", 1)
    few = post_report(client, headers["graz"], url, evaluation_report("external", 1, n_samples=10))
    assert _error(few) == (422, "invalid_report") and "below the study's privacy.min_records 20" in few.text
    mismatched = post_report(client, headers["graz"], url, evaluation_report("external", 2))
    assert _error(mismatched) == (422, "report_mismatch")
    body = evaluation_report("external", 1)
    assert post_report(client, headers["graz"], url, body).status_code == 201
    again = post_report(client, headers["graz"], url, body)
    assert (again.status_code, again.json()) == (200, body)
    other = post_report(client, headers["graz"], url, evaluation_report("external", 1, seed=9))
    assert _error(other) == (409, "report_conflict")
    assert len(_external(client, study_id)["results"]) == 1


def test_a_validation_site_that_has_not_approved_gets_no_job(client: TestClient) -> None:
    kiel = enrol(client, "kiel")
    study_id, headers = running_study(client, ("lyon",), validation_sites=["kiel"], rounds=2)
    _train(client, headers["lyon"])
    assert jobs(client, kiel) == []
    refused = post_report(client, kiel, report_url(study_id, "external", 1), evaluation_report("external", 1))
    assert _error(refused) == (409, "not_approved")


def test_a_paused_training_study_lists_no_external_job(client: TestClient) -> None:
    study_id, headers = validated_study(client, ("lyon",), ("graz",), rounds=3)
    _train(client, headers["lyon"])
    assert client.post(f"/api/v1/studies/{study_id}/pause", headers=ADMIN).status_code == 200
    assert jobs(client, headers["graz"]) == []
    refused = post_report(
        client, headers["graz"], report_url(study_id, "external", 1), evaluation_report("external", 1)
    )
    assert _error(refused) == (409, "study_not_running")


def test_the_terms_give_each_site_its_job() -> None:
    """The roles a study's terms give: which job each site has (pure: no database)."""
    survey = JobRoles.of(StudyTerms(sites=["lyon"], kind="survey"))
    trained = JobRoles.of(StudyTerms(sites=["lyon"], validation_sites=["graz"]))
    assert (survey.job_of("lyon"), survey.job_of("graz")) == (JobKind.SURVEY, None)
    assert (trained.job_of("lyon"), trained.job_of("graz")) == (None, JobKind.EXTERNAL)


def test_under_an_epsilon_budget_the_final_validated_model_is_the_last_one_trained() -> None:
    """T = 11 of 50 rounds under the budget: a running study's final model is theta^g_11, a completed one's its last."""
    terms = StudyTerms.model_validate(
        {
            "sites": ["lyon", "oslo"],
            "validation_sites": ["graz"],
            "validation_every": 4,
            "rounds": 50,
            "aggregation": {"name": "equal"},
            "privacy": {"dp": {"noise_multiplier": 10.0, "clip_norm": 1.0, "epsilon_budget": 3.0}},
        }
    )
    roles = JobRoles.of(terms)
    assert roles.trained_rounds == 11
    stored = range(12)
    assert external_rounds_due(stored, 4, final_round("running", stored, roles)) == [4, 8, 11]
    assert external_rounds_due(range(10), 4, final_round("running", range(10), roles)) == [4, 8]
    assert external_rounds_due(range(7), 4, final_round("completed", range(7), roles)) == [4, 6]
