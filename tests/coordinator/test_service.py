import pytest
from fastapi.testclient import TestClient

from coordinator.main import create_app
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, next_task, running_study, train_and_upload


def test_status_summarises_studies_rounds_and_sites(client: TestClient) -> None:
    study_id, headers = running_study(client, sites=("lyon", "oslo"))
    train_and_upload(client, headers["lyon"], 0.1, 5)
    status = client.get("/api/v1/status", headers=ADMIN).json()
    assert status["studies"] == [
        {
            "id": study_id,
            "name": "trial",
            "status": "running",
            "rounds": 2,
            "completed_rounds": 0,
            "current_round": 1,
            "round_status": "open",
            "updates_received": 1,
            "participants": 2,
            "awaiting_approval": [],
            "declined": [],
        }
    ]
    assert status["rounds"] == {"open": 1, "aggregating": 0, "completed": 0, "failed": 0, "cancelled": 0}
    sites = {s["name"]: s for s in status["sites"]}
    assert sites["lyon"]["current_task"] is None and sites["lyon"]["last_seen_at"] is not None
    round_id = next_task(client, headers["oslo"])["round_id"]
    assert sites["oslo"]["current_task"] == {"study_id": study_id, "round": 1, "round_id": round_id}


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/api/v1/nowhere", 404, "not_found"),
        ("DELETE", "/api/v1/status", 405, "method_not_allowed"),
        ("GET", "/api/v1/studies/not-a-number", 422, "invalid_request"),
    ],
)
def test_errors_are_json_with_stable_codes(client: TestClient, method: str, path: str, status: int, code: str) -> None:
    response = client.request(method, path, headers=ADMIN)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code and response.json()["error"]["message"]


def test_malformed_json_body_is_an_invalid_request(client: TestClient) -> None:
    response = client.post("/api/v1/studies", content=b"{nope", headers={**ADMIN, "Content-Type": "application/json"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"


def test_unexpected_failure_hides_its_stack_trace(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*_args: object) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr("coordinator.api.routes.status.status_report", explode)
    app = create_app(coordinator_settings_for(database_url))
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/api/v1/status", headers=ADMIN)
    assert response.status_code == 500
    assert response.json() == {
        "error": {"code": "internal_error", "message": "internal error; the coordinator's log has the details"}
    }
    assert "secret internals" not in response.text and "Traceback" not in response.text
