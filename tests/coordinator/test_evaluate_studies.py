"""Evaluate studies: a completed study's final model, named by its digests in the terms, evaluated at other sites.

Tests taking `client` run on SQLite and on PostgreSQL (tests/coordinator/conftest.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.coordinator.factories import ADMIN, enrol, reported_study, running_study, study_config
from tests.coordinator.job_factories import (
    evaluation_report,
    jobs,
    post_report,
    report_url,
    study_json,
    tick_after,
)


def _error(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def _models(client: TestClient, study_id: int) -> dict[int, dict[str, Any]]:
    listed = client.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()["data"]
    return {model["round"]: model for model in listed}


def _create(client: TestClient, sites: list[str], evaluation: dict[str, Any], **changes: Any) -> Any:
    config = study_config(sites, kind="evaluate", evaluation=evaluation, **changes)
    return client.post("/api/v1/studies", json={"name": "evaluation", "config": config}, headers=ADMIN)


@pytest.fixture()
def evaluated(client: TestClient) -> dict[str, Any]:
    """A completed two-round study of lyon and oslo: its id, uid and stored models."""
    study_id = reported_study(client, ("lyon", "oslo"))
    return {"id": study_id, "uid": study_json(client, study_id)["uid"], "models": _models(client, study_id)}


def test_creation_fills_in_the_evaluated_model_and_replaces_the_model_algorithm_and_seed(
    client: TestClient, evaluated: dict[str, Any]
) -> None:
    for site in ("bern", "rome"):
        enrol(client, site)
    created = _create(
        client,
        ["bern", "rome"],
        {"study_uid": evaluated["uid"], "adapt_local_epochs": 2},
        model={"preset": "tiny", "heads": "4:4"},
        algorithm={"name": "fedprox", "params": {"mu": 0.1}},
        seed=7,
    )
    assert created.status_code == 201, created.text
    config, source = created.json()["config"], study_json(client, evaluated["id"])["config"]
    assert (config["model"], config["algorithm"], config["seed"]) == (source["model"], source["algorithm"], 0)
    assert config["evaluation"] == {
        "study_uid": evaluated["uid"],
        "model_sha256": evaluated["models"][2]["sha256"],
        "initial_local_sha256": evaluated["models"][0]["local_sha256"],
        "rounds": 2,
        "adapt_local_epochs": 2,
    }


@pytest.mark.parametrize(
    ("named", "code"),
    [
        ({"model_sha256": "0" * 64}, "evaluated_model_mismatch"),
        ({"initial_local_sha256": "1" * 64}, "evaluated_model_mismatch"),
        ({"rounds": 1}, "evaluated_model_mismatch"),
    ],
    ids=["model", "initial local", "rounds"],
)
def test_digests_the_researcher_names_must_be_the_evaluated_studys(
    client: TestClient, evaluated: dict[str, Any], named: dict[str, Any], code: str
) -> None:
    enrol(client, "bern")
    refused = _create(client, ["bern"], {"study_uid": evaluated["uid"], **named})
    assert _error(refused) == (409, code)
    right = {"model_sha256": evaluated["models"][2]["sha256"], "rounds": 2}
    assert _create(client, ["bern"], {"study_uid": evaluated["uid"], **right}).status_code == 201


def test_only_a_completed_training_study_of_this_coordinator_can_be_evaluated(client: TestClient) -> None:
    enrol(client, "bern")
    unknown = _create(client, ["bern"], {"study_uid": "f" * 32})
    assert _error(unknown) == (422, "unknown_evaluated_study")
    running, _ = running_study(client, ("lyon",))
    not_done = _create(client, ["bern"], {"study_uid": study_json(client, running)["uid"]})
    assert _error(not_done) == (409, "evaluated_study_not_completed")
    survey, _ = running_study(client, ("oslo",), kind="survey")
    not_trained = _create(client, ["bern"], {"study_uid": study_json(client, survey)["uid"]})
    assert _error(not_trained) == (409, "wrong_study_kind")


def test_an_evaluate_study_starts_with_the_evaluated_blobs_as_its_round_0_and_opens_no_round(
    client: TestClient, evaluated: dict[str, Any]
) -> None:
    study_id, headers = running_study(client, ("bern",), kind="evaluate", evaluation={"study_uid": evaluated["uid"]})
    models = _models(client, study_id)
    final, initial = evaluated["models"][2], evaluated["models"][0]
    assert list(models) == [0]
    assert (models[0]["sha256"], models[0]["local_sha256"]) == (final["sha256"], initial["local_sha256"])
    study = study_json(client, study_id)
    assert (study["status"], study["current_round"], study["latest_global_sha256"]) == (
        "running",
        None,
        final["sha256"],
    )
    assert client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["count"] == 0
    (job,) = jobs(client, headers["bern"])
    assert {key: job[key] for key in ("kind", "round", "model_sha256", "initial_local_sha256", "report_url")} == {
        "kind": "evaluate",
        "round": 0,
        "model_sha256": final["sha256"],
        "initial_local_sha256": initial["local_sha256"],
        "report_url": report_url(study_id, "evaluate"),
    }
    theta = client.get(job["model_url"], headers=headers["bern"])
    phi = client.get(job["initial_local_url"], headers=headers["bern"])
    assert hashlib.sha256(theta.content).hexdigest() == final["sha256"]
    assert hashlib.sha256(phi.content).hexdigest() == initial["local_sha256"]


def test_an_evaluation_with_adaptation_must_report_the_adapted_model_and_completes_the_study(
    client: TestClient, evaluated: dict[str, Any]
) -> None:
    evaluation = {"study_uid": evaluated["uid"], "adapt_local_epochs": 1}
    study_id, headers = running_study(client, ("rome", "bern"), kind="evaluate", evaluation=evaluation)
    url = report_url(study_id, "evaluate")
    missing = post_report(client, headers["bern"], url, evaluation_report("evaluate"))
    assert _error(missing) == (422, "invalid_report") and "adapted" in missing.json()["error"]["message"]
    few = post_report(client, headers["bern"], url, evaluation_report("evaluate", n_samples=10, adapted=True))
    assert _error(few) == (422, "invalid_report")
    bern = evaluation_report("evaluate", seed=3, adapted=True)
    assert post_report(client, headers["bern"], url, bern).status_code == 201
    assert study_json(client, study_id)["status"] == "running"
    assert (
        post_report(client, headers["rome"], url, evaluation_report("evaluate", seed=4, adapted=True)).status_code
        == 201
    )
    assert study_json(client, study_id)["status"] == "completed"
    assert jobs(client, headers["bern"]) == []
    response = client.get(f"/api/v1/studies/{study_id}/evaluations", headers=ADMIN)
    assert response.status_code == 200, response.text
    results = response.json()
    assert (results["evaluated_study_uid"], results["model_sha256"]) == (
        evaluated["uid"],
        evaluated["models"][2]["sha256"],
    )
    assert (results["adapt_local_epochs"], results["awaiting"]) == (1, [])
    assert [r["site"] for r in results["results"]] == ["rome", "bern"]  # the terms' order
    assert results["results"][1]["evaluation"] == bern["evaluation"]
    assert (results["results"][1]["adapted"], results["results"][1]["adapt_records"]) == (bern["adapted"], 120)


def test_an_adapted_evaluation_the_terms_do_not_ask_for_is_refused(
    client: TestClient, evaluated: dict[str, Any]
) -> None:
    study_id, headers = running_study(client, ("bern",), kind="evaluate", evaluation={"study_uid": evaluated["uid"]})
    url = report_url(study_id, "evaluate")
    refused = post_report(client, headers["bern"], url, evaluation_report("evaluate", adapted=True))
    assert _error(refused) == (422, "invalid_report")
    assert post_report(client, headers["bern"], url, evaluation_report("evaluate")).status_code == 201
    assert study_json(client, study_id)["status"] == "completed"


def test_an_evaluate_study_below_quorum_at_its_deadline_fails(client: TestClient, evaluated: dict[str, Any]) -> None:
    evaluation = {"study_uid": evaluated["uid"]}
    study_id, _ = running_study(client, ("rome", "bern"), kind="evaluate", evaluation=evaluation)
    tick_after(client, 61.0)
    assert study_json(client, study_id)["status"] == "failed"
    response = client.get(f"/api/v1/studies/{study_id}/evaluations", headers=ADMIN)
    assert (response.json()["results"], response.json()["awaiting"]) == ([], ["rome", "bern"])


def test_the_views_of_other_kinds_refuse_an_evaluate_study(client: TestClient, evaluated: dict[str, Any]) -> None:
    study_id, _ = running_study(client, ("bern",), kind="evaluate", evaluation={"study_uid": evaluated["uid"]})
    for view in ("survey", "external"):
        refused = client.get(f"/api/v1/studies/{study_id}/{view}", headers=ADMIN)
        assert _error(refused) == (409, "wrong_study_kind"), view
    trained = client.get(f"/api/v1/studies/{evaluated['id']}/evaluations", headers=ADMIN)
    assert _error(trained) == (409, "wrong_study_kind")
    assert _error(client.get("/api/v1/studies/999/evaluations", headers=ADMIN)) == (404, "not_found")


def test_a_resumed_evaluate_study_opens_no_round_and_lists_its_job_again(
    client: TestClient, evaluated: dict[str, Any]
) -> None:
    study_id, headers = running_study(client, ("bern",), kind="evaluate", evaluation={"study_uid": evaluated["uid"]})
    assert client.post(f"/api/v1/studies/{study_id}/pause", headers=ADMIN).status_code == 200
    assert jobs(client, headers["bern"]) == []
    refused = post_report(client, headers["bern"], report_url(study_id, "evaluate"), evaluation_report("evaluate"))
    assert _error(refused) == (409, "study_not_running")
    resumed = client.post(f"/api/v1/studies/{study_id}/resume", headers=ADMIN)
    assert (resumed.status_code, resumed.json()["current_round"]) == (200, None)
    assert client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["count"] == 0
    assert [job["kind"] for job in jobs(client, headers["bern"])] == ["evaluate"]
