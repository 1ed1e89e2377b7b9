import pytest
from fastapi.testclient import TestClient

from tests.coordinator.factories import ADMIN, create_study, enrol, issue, running_study, study_config


def test_create_study_validates_and_stores_the_config(client: TestClient) -> None:
    enrol(client, "lyon")
    researcher = issue(client, "researcher")
    response = client.post(
        "/api/v1/studies",
        json={"name": "ptbxl-6-2", "config": study_config(["lyon"], seed=3, aggregation={"name": "equal"})},
        headers=researcher,
    )
    assert response.status_code == 201
    study = response.json()
    assert study["status"] == "draft" and study["name"] == "ptbxl-6-2" and study["created_by"].startswith("token:")
    assert study["config"]["aggregation"] == {"name": "equal", "params": {}}
    assert study["config"]["training"] == {
        "optimizer": "sgd",
        "lr": 0.1,
        "momentum": 0.0,
        "weight_decay": 0.0,
        "batch_size": 32,
        "local_epochs": 1,
        "max_steps": None,
    }
    assert study["current_round"] is None and study["completed_rounds"] == 0
    assert client.get(f"/api/v1/studies/{study['id']}", headers=researcher).json() == study
    listed = client.get("/api/v1/studies", headers=researcher).json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == study["id"]


@pytest.mark.parametrize(
    ("config", "code", "text"),
    [
        ({"sites": ["lyon", "ghost"]}, "unknown_sites", "ghost"),
        ({"sites": ["lyon"], "algorithm": {"name": "fedmagic"}}, "invalid_request", "unknown algorithm"),
        ({"sites": ["lyon"], "model": {"preset": "tiny", "heads": "9:x"}}, "invalid_request", "head split"),
        ({"sites": ["lyon"], "min_sites": 2}, "invalid_request", "exceeds"),
        (
            {
                "sites": ["lyon"],
                "algorithm": {"name": "local"},
                "aggregation": {"name": "equal"},
                "privacy": {"dp": {"noise_multiplier": 1, "clip_norm": 1}},
            },
            "invalid_request",
            "body.config.privacy.dp: dp clips and noises what sites upload, and algorithm 'local' uploads no tensor",
        ),
        ({"sites": []}, "invalid_request", "sites"),
    ],
)
def test_create_study_refuses_bad_configs(client: TestClient, config: dict, code: str, text: str) -> None:
    enrol(client, "lyon")
    response = client.post("/api/v1/studies", json={"name": "x", "config": config}, headers=ADMIN)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == code and text in response.json()["error"]["message"]
    assert client.get("/api/v1/studies", headers=ADMIN).json()["count"] == 0


def test_start_opens_round_one_for_every_site(client: TestClient) -> None:
    study_id, _ = running_study(client)
    study = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert study["status"] == "running" and study["current_round"] == 1 and study["latest_global_sha256"]
    rounds = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()
    assert rounds["count"] == 1
    assert rounds["data"][0]["participants"] == {"lyon": 1.0, "oslo": 1.0}
    assert rounds["data"][0]["base_sha256"] == study["latest_global_sha256"]


@pytest.mark.parametrize(
    ("steps", "refused"),
    [
        (["pause"], "pause"),  # a draft cannot pause
        (["start", "start"], "start"),
        (["start", "resume"], "resume"),
        (["start", "pause", "pause"], "pause"),
        (["start", "cancel", "resume"], "resume"),
        (["cancel", "cancel"], "cancel"),
    ],
)
def test_invalid_transitions_conflict(client: TestClient, steps: list[str], refused: str) -> None:
    enrol(client, "lyon")
    study_id = create_study(client, ["lyon"])
    *allowed, last = steps
    for step in allowed:
        assert client.post(f"/api/v1/studies/{study_id}/{step}", headers=ADMIN).status_code == 200
    response = client.post(f"/api/v1/studies/{study_id}/{last}", headers=ADMIN)
    assert response.status_code == 409 and response.json()["error"]["code"] == "invalid_transition"
    assert last == refused


def test_cancel_cancels_the_open_round(client: TestClient) -> None:
    study_id, headers = running_study(client)
    assert client.post(f"/api/v1/studies/{study_id}/cancel", headers=ADMIN).json()["status"] == "cancelled"
    round_ = client.get(f"/api/v1/studies/{study_id}/rounds/1", headers=ADMIN).json()
    assert round_["status"] == "cancelled" and round_["note"] == "study cancelled"
    assert client.get("/api/v1/tasks/next", headers=headers["lyon"]).status_code == 204


def test_unknown_study_and_round_are_not_found(client: TestClient) -> None:
    study_id, _ = running_study(client)
    for path in ("/api/v1/studies/77", f"/api/v1/studies/{study_id}/rounds/9", "/api/v1/studies/77/rounds"):
        response = client.get(path, headers=ADMIN)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_audit_trail_of_a_study(client: TestClient) -> None:
    study_id, _ = running_study(client)
    events = client.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    assert [e["action"] for e in events] == [
        "study.created",
        "site.approved",
        "site.approved",
        "study.running",
        "round.opened",
    ]
    assert events[4]["detail"]["participants"] == {"lyon": 1.0, "oslo": 1.0}


def test_a_buffered_study_s_terms_are_checked_whole_at_creation(client: TestClient) -> None:
    refused = study_config(["a", "b"], buffered={"buffer_size": 3})  # more than the sites
    response = client.post("/api/v1/studies", json={"name": "async", "config": refused}, headers=ADMIN)
    assert response.status_code == 422 and "buffered.buffer_size" in response.text
    secure = study_config(["a", "b"], buffered={"buffer_size": 2}, privacy={"secure_aggregation": {}})
    response = client.post("/api/v1/studies", json={"name": "async", "config": secure}, headers=ADMIN)
    assert response.status_code == 422 and "synchronous cohort" in response.text, response.text
