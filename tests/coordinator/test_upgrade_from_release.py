"""A database made by release 0.1.0, with studies in it, migrated to this one; its studies go on."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from tests.coordinator.factories import (
    ADMIN,
    approve,
    evaluate_and_upload,
    next_task,
    site_headers,
    train_and_upload,
)
from tests.coordinator.releases import MAKE_STUDIES, release_tree, run_release, upgraded_app

PREVIOUS_RELEASE = "6aa681b"  # cardiofl 0.1.0: schema 0004, protocol 1 (agents send no version)


def test_a_database_of_the_previous_release_upgrades_and_its_studies_go_on(
    empty_database_url: str, tmp_path: Path
) -> None:
    # The previous release's own schema, and studies made through its own API.
    old = run_release(release_tree(PREVIOUS_RELEASE, tmp_path / "previous"), empty_database_url, MAKE_STUDIES)

    with upgraded_app(empty_database_url) as client:
        studies = {s["id"]: s for s in client.get("/api/v1/studies", headers=ADMIN).json()["data"]}
        assert {studies[old["running"]]["status"], studies[old["draft"]]["status"]} == {"running", "draft"}
        assert studies[old["running"]]["completed_rounds"] == 1  # round 1 was aggregated by the old release
        assert len({s["uid"] for s in studies.values()}) == 2  # every old study got a uid of its own

        # An agent of the old release is told to upgrade; one of this release takes the study to its end.
        lyon_token = old["tokens"]["lyon"]
        refused = client.get("/api/v1/tasks/next", headers={"Authorization": f"Bearer {lyon_token}"})
        assert refused.status_code == 426 and refused.json()["error"]["code"] == "agent_too_old"
        sites = {name: site_headers(token) for name, token in old["tokens"].items()}
        assert next_task_status(client, sites["lyon"]) == 204  # this release's agent first approves the study
        for site in sites.values():
            approve(client, site, old["running"])
            approve(client, site, old["draft"])
        task = next_task(client, sites["lyon"])
        assert (task["round"], task["study_uid"]) == (2, studies[old["running"]]["uid"])
        for delta, site in enumerate(sites.values(), start=1):
            assert train_and_upload(client, site, float(delta), 10 * delta).status_code == 201
        for site in sites.values():
            assert evaluate_and_upload(client, site).status_code == 201
        finished = client.get(f"/api/v1/studies/{old['running']}", headers=ADMIN).json()
        assert (finished["status"], finished["completed_rounds"]) == ("completed", 2)
        started = client.post(f"/api/v1/studies/{old['draft']}/start", headers=ADMIN)
        assert started.status_code == 200 and next_task(client, sites["oslo"])["study_id"] == old["draft"]


def next_task_status(client: TestClient, headers: dict[str, str]) -> int:
    """The status of the site's poll for a task."""
    return client.get("/api/v1/tasks/next", headers=headers).status_code
