"""The approval page's Decline: the reviewed digest and a reason, as the CLI records it; the site's declines shown."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from typer.testing import CliRunner

from site_agent.approvals import record_task_decline, study_key
from site_agent.cli.app import site_app
from tests.coordinator.factories import create_study, offer
from tests.site_agent.test_agent import SITES
from tests.site_agent.test_site_ui import ORIGIN, _clean_environ_and_signals, approval_of, page_of, site

__all__ = ["_clean_environ_and_signals", "site"]

runner = CliRunner()
REASON = "our ethics board has not cleared this cohort"


def test_decline_records_exactly_what_the_cli_records_and_tells_the_coordinator(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, headers = site
    study_id = create_study(coordinator, list(SITES))
    key = study_key(study_id, offer(coordinator, headers, study_id).study_uid)
    page = page_of(config)
    digest = page.state()["studies"][0]["digest"]
    flags = ["--config", str(config), "--digest", digest, "--reason", REASON]
    result = runner.invoke(site_app, ["decline", str(study_id), *flags])
    assert result.exit_code == 0, result.output
    by_cli = page.ui.approvals.store.load_record("decline", key)
    assert page.post(study_id, "approve", {"digest": digest}).status_code == 200  # an approval replaces it

    declined = page.post(study_id, "decline", {"digest": digest, "reason": REASON})
    assert declined.status_code == 200, declined.text
    assert declined.json()["message"].startswith(f"declined study {study_id} (digest {digest})")
    by_page = page.ui.approvals.store.load_record("decline", key)
    assert by_page is not None and by_cli is not None
    assert by_page.pop("declined_at") and by_cli.pop("declined_at")
    assert by_page == by_cli  # the same digest, study, operator and reason
    assert page.ui.approvals.store.approved_studies() == []  # the decline revoked the approval
    assert approval_of(coordinator, study_id) == "declined"

    state = page.state()
    (shown,) = state["studies"]
    assert shown["state"] == "declined" and shown["recorded"] is None
    assert shown["declined"]["reason"] == REASON and shown["declined"]["digest"] == digest
    (row,) = state["site"]["declines"]
    assert (row["what"], row["study_id"], row["digest"], row["reason"]) == ("study", study_id, digest, REASON)
    again = page.post(study_id, "decline", {"digest": digest, "reason": "another"})
    assert again.json()["message"] == f"study {study_id} is already declined"
    assert page.post(study_id, "revoke").status_code == 404  # nothing approved to revoke


def test_a_decline_names_the_current_digest_and_a_reason(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, _ = site
    study_id = create_study(coordinator, list(SITES))
    page = page_of(config)
    digest = page.state()["studies"][0]["digest"]
    refused = page.post(study_id, "decline", {"digest": "a" * 64, "reason": REASON})
    assert refused.status_code == 409 and "nothing was declined" in refused.json()["detail"]
    assert page.post(study_id, "decline", {"digest": digest}).status_code == 422  # no reason
    assert page.post(study_id, "decline", {"digest": digest, "reason": ""}).status_code == 422
    blank = page.post(study_id, "decline", {"digest": digest, "reason": "  \n "})
    assert blank.status_code == 422 and "reason" in blank.json()["detail"]
    assert page.post(study_id, "decline", {"digest": digest, "reason": "x" * 2_001}).status_code == 422
    assert page.post(study_id + 100, "decline", {"digest": digest, "reason": REASON}).status_code == 404
    assert page.state()["site"]["declines"] == []
    assert approval_of(coordinator, study_id) == "not reported"


def test_a_decline_needs_the_pages_token_and_its_origin(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, _ = site
    study_id = create_study(coordinator, list(SITES))
    page = page_of(config)
    body = {"digest": page.state()["studies"][0]["digest"], "reason": REASON}
    path = f"/api/studies/{study_id}/decline"
    assert page.http.post(path, json=body, headers={"Origin": ORIGIN}).status_code == 401
    assert page.post(study_id, "decline", body, Origin="http://evil.example").status_code == 403
    assert page.post(study_id, "decline", body, **{"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert page.http.post(path, data=body, headers=page.headers()).status_code == 415
    assert page.state()["site"]["declines"] == []
    assert approval_of(coordinator, study_id) == "not reported"


def test_the_sites_state_lists_the_agents_declines_of_tasks_newest_first(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, _ = site
    page = page_of(config)
    store = page.ui.approvals.store
    record_task_decline(store, round_id=7, reason="the task is not a valid protocol task")
    record_task_decline(store, round_id=8, reason="study 1 round 2: its terms differ at training.lr")
    rows = page.state()["site"]["declines"]
    assert [row["what"] for row in rows] == ["task", "task"]
    assert {row["reason"] for row in rows} == {
        "the task is not a valid protocol task",
        "study 1 round 2: its terms differ at training.lr",
    }
    assert all(row["by"] == "this site's agent" for row in rows)
    assert rows == sorted(rows, key=lambda row: row["at"], reverse=True)
