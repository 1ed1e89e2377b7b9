import re
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from coordinator import main
from coordinator.api.routes import tasks as tasks_route
from coordinator.db import utc_now
from coordinator.main import create_app
from coordinator.models import Role
from coordinator.sites.access import revoke_token
from coordinator.sites.security import Principal
from coordinator.studies.lifecycle import start_study
from shared.labels import CLASS_NAMES
from shared.wire.protocol import PROTOCOL_VERSION
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, approve, create_study, enrol, next_task, running_study


def test_no_task_answers_204_after_waiting(client: TestClient) -> None:
    headers = enrol(client, "lyon")
    started = time.monotonic()
    response = client.get("/api/v1/tasks/next", params={"wait": 0.3}, headers=headers)
    assert response.status_code == 204 and response.content == b""
    assert time.monotonic() - started >= 0.25


def test_wait_is_capped_by_the_server(database_url: str) -> None:
    with TestClient(create_app(coordinator_settings_for(database_url, max_poll_wait_s=0.1))) as client:
        headers = enrol(client, "lyon")
        started = time.monotonic()
        assert client.get("/api/v1/tasks/next", params={"wait": 30}, headers=headers).status_code == 204
        assert time.monotonic() - started < 5


def test_long_poll_returns_as_soon_as_a_round_opens(client: TestClient) -> None:
    headers = enrol(client, "lyon")
    study_id = create_study(client, ["lyon"])
    approve(client, headers, study_id)
    sessions = client.app.state.coordinator.sessions

    def start() -> None:
        with sessions() as session:
            start_study(session, study_id=study_id, by=Principal(Role.ADMIN, actor="test"), now=utc_now())

    response, waited = _poll_while(client, headers, start)
    assert response.status_code == 200 and response.json()["study_id"] == study_id
    assert waited < 10  # woken, long before its wait of 20 s ran out


def _poll_while(client: TestClient, headers: dict[str, str], action: Callable[[], None]) -> tuple[Response, float]:
    """GET /tasks/next?wait=20 while `action` runs 0.3 s later in another thread: the answer, and seconds taken."""

    def later() -> None:
        time.sleep(0.3)
        action()

    thread = threading.Thread(target=later)
    thread.start()
    started = time.monotonic()
    response = client.get("/api/v1/tasks/next", params={"wait": 20}, headers=headers)
    waited = time.monotonic() - started
    thread.join()
    return response, waited


def test_task_names_everything_the_agent_needs(client: TestClient) -> None:
    study_id, headers = running_study(client, training={"lr": 0.05, "batch_size": 8, "max_steps": 3}, seed=9)
    task = next_task(client, headers["oslo"])
    round_id = task["round_id"]
    assert re.fullmatch("[0-9a-f]{32}", task["study_uid"])
    assert task == {
        "protocol": PROTOCOL_VERSION,
        "study_id": study_id,
        "study_uid": task["study_uid"],
        "site": "oslo",
        "terms": {  # the study's terms whole, defaults filled in (shared/terms/study_terms.py StudyTerms)
            "sites": ["lyon", "oslo"],
            "model": {"preset": "tiny", "heads": "6:2"},
            "labels": list(CLASS_NAMES),
            "training": {
                "optimizer": "sgd",
                "lr": 0.05,
                "momentum": 0.0,
                "weight_decay": 0.0,
                "batch_size": 8,
                "local_epochs": 1,
                "max_steps": 3,
            },
            "algorithm": {"name": "fedavg", "params": {}},
            "aggregation": {"name": "samples", "params": {}},
            "participation": {"name": "all", "params": {}},
            "rounds": 2,
            "min_sites": 1,
            "round_deadline_s": 60.0,
            "round_retries": 2,
            "seed": 9,
            "keep_updates": False,
            "privacy": {"min_records": 20, "dp": None, "secure_aggregation": None},
        },
        "round_id": round_id,
        "round": 1,
        "attempt": 1,
        "kind": "train",
        "participants": ["lyon", "oslo"],
        "load_factor": 1.0,
        "global_model_round": 0,
        "global_model_sha256": task["global_model_sha256"],
        "global_model_url": f"/api/v1/studies/{study_id}/models/0",
        "initial_local_sha256": task["initial_local_sha256"],
        "initial_local_url": f"/api/v1/studies/{study_id}/models/0/local",
        "update_url": f"/api/v1/rounds/{round_id}/updates",
        "decline_url": f"/api/v1/rounds/{round_id}/decline",
        "deadline": task["deadline"],
        "secure": None,  # a plain round (a secure round carries its SecureRoundInfo)
    }
    models = client.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()["data"]
    assert models[0]["sha256"] == task["global_model_sha256"]
    assert models[0]["local_sha256"] == task["initial_local_sha256"]


def test_oldest_open_round_comes_first_across_studies(client: TestClient) -> None:
    first, headers = running_study(client, sites=("lyon",))
    second = create_study(client, ["lyon"])
    approve(client, headers["lyon"], second)
    client.post(f"/api/v1/studies/{second}/start", headers=ADMIN)
    assert next_task(client, headers["lyon"])["study_id"] == first


def test_revoking_a_token_ends_its_long_poll(client: TestClient) -> None:
    headers = enrol(client, "lyon")
    token_id = client.get("/api/v1/tokens/me", headers=headers).json()["token_id"]
    sessions = client.app.state.coordinator.sessions

    def revoke() -> None:
        with sessions() as session:
            revoke_token(session, token_id=token_id, by=Principal(Role.ADMIN, actor="test"))

    response, waited = _poll_while(client, headers, revoke)
    assert response.status_code == 401 and waited < 10  # the revocation woke it


def test_waiting_polls_look_once_each_and_the_process_reads_the_work_version_once_per_interval(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks, version_reads = Counter(), []
    real_next_task, real_work_version = tasks_route.next_task, main.work_version

    def counted_next_task(session, site):  # noqa: ANN001, ANN202 (the route's own signature)
        looks[site.site_name] += 1
        return real_next_task(session, site)

    def counted_work_version(engine):  # noqa: ANN001, ANN202
        version_reads.append(time.monotonic())
        return real_work_version(engine)

    monkeypatch.setattr(tasks_route, "next_task", counted_next_task)
    monkeypatch.setattr(main, "work_version", counted_work_version)
    interval, wait, sites = 0.05, 1.0, [f"site{i}" for i in range(6)]
    with TestClient(create_app(coordinator_settings_for(database_url, task_poll_interval_s=interval))) as client:
        headers = {name: enrol(client, name) for name in sites}
        answers: dict[str, int] = {}

        def poll(name: str) -> None:
            answers[name] = client.get("/api/v1/tasks/next", params={"wait": wait}, headers=headers[name]).status_code

        version_reads.clear()
        pollers = [threading.Thread(target=poll, args=(name,)) for name in sites]
        for poller in pollers:
            poller.start()
        for poller in pollers:
            poller.join()
    assert answers == dict.fromkeys(sites, 204)
    assert looks == dict.fromkeys(sites, 2)  # when it came and when its wait ran out, no query in between
    assert 0 < len(version_reads) <= 1.5 * wait / interval + 2  # one process's reads, whatever the number of polls


def test_work_another_process_gives_wakes_a_waiting_poll(database_url: str) -> None:
    settings = coordinator_settings_for(database_url, task_poll_interval_s=0.05)
    with TestClient(create_app(settings)) as polled, TestClient(create_app(settings)) as other:
        headers = enrol(polled, "lyon")
        study_id = create_study(polled, ["lyon"])
        approve(polled, headers, study_id)

        def start_there() -> None:
            assert other.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200

        response, waited = _poll_while(polled, headers, start_there)
    assert response.status_code == 200 and response.json()["study_id"] == study_id
    assert waited < 10  # woken by the work version, long before the wait ran out
