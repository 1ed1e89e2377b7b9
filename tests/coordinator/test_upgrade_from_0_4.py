"""A database of release 0.4.0 with a running study, migrated to this release: its sites approve again, it finishes.

Release 0.4.0's sites approved the digest of description format 1, of protocol 4: migration 0008
renews every approval (description format 2 digests the terms whole), so the running study waits
until each site's operator approves its terms again, then takes round 2 and the final evaluation.
Downgraded to 0007 again, the database is one that 0.4.0's own code reads and serves.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command

from coordinator.db import make_engine
from coordinator.migrate import alembic_config
from shared.labels import CLASS_NAMES
from shared.wire.protocol import PROTOCOL_HEADER
from tests.coordinator.factories import (
    ADMIN,
    approve,
    bearer,
    evaluate_and_upload,
    next_task,
    site_headers,
    train_and_upload,
)
from tests.coordinator.releases import MAKE_STUDIES, release_tree, run_release, upgraded_app

RELEASE_0_4 = "2e38279"  # cardiofl 0.4.0: schema 0007, protocol 4, approvals of description format 1

# The digest each site approved the running study under (0.4.0 records it with the approval), and the studies'
# configs as 0.4.0 shows them.
APPROVALS_AND_CONFIGS = """
assert {offer(client, site, running).approval.state for site in headers.values()} == {"approved"}
result["digests"] = {name: offer(client, site, running).approval.digest for name, site in headers.items()}
result["configs"] = {s["id"]: s["config"] for s in client.get("/api/v1/studies", headers=ADMIN).json()["data"]}
"""

# What 0.4.0 makes of the downgraded database: its studies, their offers to site sys.argv[2] and, once
# that site approved study sys.argv[3] the 0.4.0 way (its own digest), the site's next task.
READ_STUDIES = """
studies = client.get("/api/v1/studies", headers=ADMIN).json()["data"]
site = site_headers(sys.argv[2])
offers = client.get("/api/v1/sites/me/studies", params={"finished": True}, headers=site)
assert offers.status_code == 200, offers.text
approve(client, site, int(sys.argv[3]))
polled = client.get("/api/v1/tasks/next", headers=site)
assert polled.status_code == 200, polled.text
result = {
    "studies": {s["id"]: [s["status"], s["completed_rounds"], s["config"]] for s in studies},
    "offered": sorted(item["study_id"] for item in offers.json()["data"]),
    "task": [polled.json()["study_id"], polled.json()["round"], polled.json()["kind"]],
}
"""


def _stored_terms(database_url: str) -> dict[int, dict]:
    """Study id -> its terms as the database holds them (the JSON of column studies.terms)."""
    studies = sa.table("studies", sa.column("id", sa.Integer()), sa.column("terms", sa.JSON()))
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return dict(connection.execute(sa.select(studies.c.id, studies.c.terms)).all())
    finally:
        engine.dispose()


def _downgrade(database_url: str, revision: str) -> None:
    """Run this tree's migrations down to `revision`."""
    engine = make_engine(database_url)
    try:
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), revision)
    finally:
        engine.dispose()


def test_a_database_of_0_4_upgrades_its_sites_approve_again_and_its_study_finishes(
    empty_database_url: str, tmp_path: Path
) -> None:
    # Release 0.4.0's own schema, and studies made and approved through its own API.
    tree = release_tree(RELEASE_0_4, tmp_path / "release-0.4.0")
    old = run_release(tree, empty_database_url, MAKE_STUDIES, APPROVALS_AND_CONFIGS)
    running, draft = old["running"], old["draft"]

    with upgraded_app(empty_database_url) as client:
        studies = {s["id"]: s for s in client.get("/api/v1/studies", headers=ADMIN).json()["data"]}
        assert (studies[running]["status"], studies[running]["completed_rounds"]) == ("running", 1)
        assert (studies[draft]["status"], studies[draft]["completed_rounds"]) == ("draft", 0)
        stored = _stored_terms(empty_database_url)
        assert all(stored[study]["labels"] == list(CLASS_NAMES) for study in (running, draft))  # 0008 wrote them

        # 0.4.0's approvals were of another digest: every site awaits its operator's approval again.
        shown = client.get(f"/api/v1/studies/{running}", headers=ADMIN).json()
        assert shown["approvals"] == {"lyon": "awaiting approval", "oslo": "awaiting approval"}
        assert client.get(f"/api/v1/studies/{draft}", headers=ADMIN).json()["approvals"] == {
            "lyon": "not reported",
            "oslo": "not reported",
        }
        sites = {name: site_headers(token) for name, token in old["tokens"].items()}
        assert client.get("/api/v1/tasks/next", headers=sites["lyon"]).status_code == 204  # no task before it

        # The approval 0.4.0 recorded is no approval of these terms here; a 0.4.0 agent is told to upgrade.
        stale = client.put(
            f"/api/v1/sites/me/studies/{running}/approval",
            json={"state": "approved", "digest": old["digests"]["lyon"]},
            headers=sites["lyon"],
        )
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "approval_digest_mismatch"
        agent_0_4 = {**bearer(old["tokens"]["lyon"]), PROTOCOL_HEADER: "4"}
        too_old = client.get("/api/v1/tasks/next", headers=agent_0_4)
        assert too_old.status_code == 426 and too_old.json()["error"]["code"] == "agent_too_old"

        # Each site approves the study's terms again (format 2), takes round 2 and the final evaluation.
        for name, site in sites.items():
            assert approve(client, site, running) != old["digests"][name]
        assert client.get(f"/api/v1/studies/{running}", headers=ADMIN).json()["approvals"] == {
            "lyon": "approved",
            "oslo": "approved",
        }
        for delta, site in enumerate(sites.values(), start=1):
            task = next_task(client, site)
            assert (task["study_id"], task["round"], task["study_uid"]) == (running, 2, shown["uid"])
            assert task["terms"] == shown["config"] and task["terms"]["labels"] == list(CLASS_NAMES)
            assert train_and_upload(client, site, float(delta), 10 * delta).status_code == 201
        for site in sites.values():
            assert evaluate_and_upload(client, site).status_code == 201
        finished = client.get(f"/api/v1/studies/{running}", headers=ADMIN).json()
        assert (finished["status"], finished["completed_rounds"]) == ("completed", 2)

        # The draft 0.4.0 made starts under this release, once its sites approved it.
        for site in sites.values():
            approve(client, site, draft)
        started = client.post(f"/api/v1/studies/{draft}/start", headers=ADMIN)
        assert started.status_code == 200, started.text
        task = next_task(client, sites["oslo"])
        assert (task["study_id"], task["round"]) == (draft, 1) and task["terms"]["labels"] == list(CLASS_NAMES)

    # Rolled back: 0007's database is one 0.4.0 reads (no labels in its configs) and serves to its agents.
    _downgrade(empty_database_url, "0007")
    back = run_release(tree, empty_database_url, READ_STUDIES, args=[old["tokens"]["lyon"], str(draft)])
    assert back == {
        "studies": {
            str(running): ["completed", 2, old["configs"][str(running)]],
            str(draft): ["running", 0, old["configs"][str(draft)]],
        },
        "offered": [running, draft],
        "task": [draft, 1, "train"],
    }
