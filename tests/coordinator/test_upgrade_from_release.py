"""A database made by the previous release, with studies in it, migrated to this one; its studies go on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.db import make_engine
from coordinator.main import create_app
from coordinator.migrate import upgrade_database
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import (
    ADMIN,
    approve,
    evaluate_and_upload,
    next_task,
    site_headers,
    train_and_upload,
)

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_RELEASE = "6aa681b"  # cardiofl 0.1.0: schema 0004, protocol 1 (agents send no version)

# Run by the previous release's own code: its schema, and studies made through its own API.
MAKE_OLD_DATABASE = """
import json, sys
from fastapi.testclient import TestClient
from coordinator.db import make_engine
from coordinator.main import create_app
from coordinator.migrate import upgrade_database
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import create_study, running_study, train_and_upload

url = sys.argv[1]
engine = make_engine(url)
upgrade_database(engine)
engine.dispose()
with TestClient(create_app(coordinator_settings_for(url))) as client:
    running, headers = running_study(client, rounds=2)
    for delta, (name, site) in enumerate(headers.items(), start=1):
        assert train_and_upload(client, site, float(delta), 10 * delta).status_code == 201
    draft = create_study(client, list(headers))
    tokens = {name: site["Authorization"].removeprefix("Bearer ") for name, site in headers.items()}
print(json.dumps({"running": running, "draft": draft, "tokens": tokens}))
"""


def _previous_release(into: Path) -> Path:
    """The previous release's tree, from this repository's history (skip where there is none)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", PREVIOUS_RELEASE], capture_output=True, check=False
    )
    if archive.returncode != 0:
        pytest.skip(f"the previous release {PREVIOUS_RELEASE} is not in this checkout's git history")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def test_a_database_of_the_previous_release_upgrades_and_its_studies_go_on(
    empty_database_url: str, tmp_path: Path
) -> None:
    old_tree = _previous_release(tmp_path / "previous")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")} | {"PYTHONPATH": str(old_tree)}
    made = subprocess.run(
        [sys.executable, "-c", MAKE_OLD_DATABASE, empty_database_url],
        cwd=old_tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    old = json.loads(made.stdout.strip().splitlines()[-1])

    engine = make_engine(empty_database_url)
    upgrade_database(engine)
    engine.dispose()
    with TestClient(create_app(coordinator_settings_for(empty_database_url))) as client:
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
