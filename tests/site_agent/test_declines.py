"""The data owner may decline a study: the site reports it declined, trains for none of it, and keeps why."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from shared.study.description import describe
from shared.wire.protocol import TaskSpec
from site_agent.approvals import TASK_DECLINES_KEPT, Approvals, record_task_decline, study_key, task_declines
from site_agent.cli import approvals as cli_approvals
from site_agent.data import SiteData
from site_agent.errors import AgentError
from site_agent.store import SiteStore, generate_key
from tests.coordinator.factories import ADMIN, approve, create_study, enrol, offer
from tests.site_agent.test_agent import SITES, make_worker, site_data
from tests.site_agent.test_approvals import approvals_of, started, status_line, uploads, worker_for
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals", "site_data"]

runner = CliRunner()
REASON = "the cohort is not covered by our ethics approval"


def lyon_approvals(coordinator: TestClient, tmp_path: Path, **kw: bool) -> tuple[Approvals, dict[str, str], int]:
    """Site lyon's approvals over a fresh store, a draft study over SITES; (approvals, lyon's headers, study id)."""
    headers = enrol(coordinator, "lyon")
    enrol(coordinator, "oslo")
    study_id = create_study(coordinator, list(SITES))
    return Approvals(SiteStore(tmp_path / "store", generate_key(), "lyon"), **kw), headers, study_id


# -- the site's record -----------------------------------------------------------------------------------


def test_a_decline_revokes_an_approval_and_an_approval_replaces_a_decline(
    coordinator: TestClient, tmp_path: Path
) -> None:
    approvals, headers, study_id = lyon_approvals(coordinator, tmp_path)
    offered = offer(coordinator, headers, study_id)
    key = study_key(study_id, offered.study_uid)
    approvals.approve(offered, by="operator ana")
    assert approvals.decide(offered).state == "approved"

    record = approvals.decline(offered, by="operator ana", reason=f"  {REASON}\n")
    decision = approvals.decide(offered)
    assert decision.state == "declined" and decision.declined and not decision.approved
    assert approvals.store.load_approval(key) is None and approvals.store.approved_studies() == []
    assert record["digest"] == decision.digest and record["reason"] == REASON
    assert record["declined_by"] == "operator ana" and record["declined_at"]
    assert approvals.declines() == [record]
    raw = (tmp_path / "store" / "studies" / key / "record-decline.enc").read_bytes()
    assert b"ethics" not in raw and b"ana" not in raw  # encrypted at rest, as approvals are

    approvals.approve(offered, by="operator ana")
    decision = approvals.decide(offered)
    assert decision.state == "approved" and decision.decline is None and approvals.declines() == []


def test_a_decline_needs_a_reason(coordinator: TestClient, tmp_path: Path) -> None:
    approvals, headers, study_id = lyon_approvals(coordinator, tmp_path)
    offered = offer(coordinator, headers, study_id)
    for reason in ("", "   \n", "x" * 2_001):
        with pytest.raises(AgentError, match="reason"):
            approvals.decline(offered, by="operator", reason=reason)
    assert approvals.decide(offered).state == "awaiting_approval"


def test_a_study_changed_since_its_decline_awaits_approval_again(coordinator: TestClient, tmp_path: Path) -> None:
    approvals, headers, study_id = lyon_approvals(coordinator, tmp_path)
    offered = offer(coordinator, headers, study_id)
    earlier = offered.terms.model_copy(update={"rounds": offered.terms.rounds + 1})
    description = describe(earlier, study_uid=offered.study_uid, site="lyon", protocol=offered.protocol)
    approvals.decline(offered, by="operator", reason=REASON, description=description)
    decision = approvals.decide(offered)
    assert decision.state == "awaiting_approval" and not decision.declined
    assert decision.decline is not None and decision.decline["digest"] == description.digest() != decision.digest


def test_auto_approve_never_overrides_a_decline(coordinator: TestClient, tmp_path: Path) -> None:
    approvals, headers, study_id = lyon_approvals(coordinator, tmp_path, auto_approve=True)
    offered = offer(coordinator, headers, study_id)
    approvals.decline(offered, by="operator", reason=REASON)
    assert approvals.decide(offered).state == "declined"
    assert approvals.store.approved_studies() == []


# -- the coordinator ---------------------------------------------------------------------------------------


def test_the_coordinator_shows_a_declined_site_and_offers_it_no_task(coordinator: TestClient) -> None:
    headers = {name: enrol(coordinator, name) for name in SITES}
    study_id = started(coordinator)
    approve(coordinator, headers["lyon"], study_id)
    approve(coordinator, headers["oslo"], study_id, state="declined")
    assert approvals_of(coordinator, study_id) == {"lyon": "approved", "oslo": "declined"}
    line = status_line(coordinator, study_id)
    assert line["declined"] == ["oslo"] and line["awaiting_approval"] == []
    sites = {s["name"]: s for s in coordinator.get("/api/v1/status", headers=ADMIN).json()["sites"]}
    assert sites["oslo"]["current_task"] is None
    assert coordinator.get("/api/v1/tasks/next", headers=headers["oslo"]).status_code == 204
    audit = coordinator.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    assert "site.declined" in {event["action"] for event in audit}


def test_the_agent_reports_a_declined_study_without_nagging_and_trains_for_none_of_it(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {name: enrol(coordinator, name) for name in SITES}
    study_id = started(coordinator, rounds=1)
    lyon, wire = worker_for(coordinator, "lyon", headers["lyon"], tmp_path, site_data["lyon"], auto=True)
    current = next(o for o in lyon.client.offers() if o.study_id == study_id)
    lyon.approvals.decline(current, by="operator test", reason=REASON)
    with caplog.at_level(logging.INFO, logger="site_agent.approvals"):
        assert not lyon.poll_once()  # auto_approve or not: declined, so no task
    assert approvals_of(coordinator, study_id)["lyon"] == "declined"
    assert uploads(wire) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "awaits" in r.getMessage()]
    assert REASON not in json.dumps([body.decode(errors="replace") for _, body in wire.bodies])  # stays here


# -- the agent's declines of tasks ---------------------------------------------------------------------------


def test_the_worker_keeps_its_declines_of_tasks_in_the_store(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    headers = {name: enrol(coordinator, name) for name in SITES}
    study_id = started(coordinator, rounds=2)
    key = generate_key()
    lyon, _ = make_worker(coordinator, "lyon", headers["lyon"], tmp_path / "lyon", key, site_data["lyon"])
    lyon.approvals.auto_approve = False
    lyon.approvals.approve(next(o for o in lyon.client.offers() if o.study_id == study_id), by="operator test")
    lyon.approvals.sync(lyon.client)
    task = lyon.client.next_task()
    assert task is not None
    terms = task.terms.model_dump(mode="json")
    hostile = TaskSpec.model_validate({**task.model_dump(mode="json"), "terms": {**terms, "keep_updates": True}})
    lyon.handle(hostile)
    lyon._decline(task.round_id, lyon.declined[task.round_id])  # said again: kept once
    (kept,) = task_declines(lyon.store)
    assert (kept["study_id"], kept["round"], kept["round_id"]) == (study_id, task.round, task.round_id)
    assert "keep_updates" in kept["reason"] and kept["at"]
    assert task_declines(SiteStore(tmp_path / "lyon", key, "lyon")) == [kept]  # in the store, not only in memory


def test_the_task_declines_kept_are_bounded(tmp_path: Path) -> None:
    store = SiteStore(tmp_path / "store", generate_key(), "lyon")
    for round_id in range(TASK_DECLINES_KEPT + 10):
        record_task_decline(store, round_id=round_id, reason=f"reason {round_id}")
    kept = task_declines(store)
    assert len(kept) == TASK_DECLINES_KEPT and kept[-1]["round_id"] == TASK_DECLINES_KEPT + 9
    assert kept[0]["round_id"] == 10 and kept[0]["study_id"] is None


# -- the operator's command ----------------------------------------------------------------------------------


@pytest.fixture()
def site_config(
    tmp_path: Path, coordinator: TestClient, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, dict[str, str]]:
    """Site lyon's config, its commands talking to the in-process coordinator; (config, lyon's headers)."""
    headers = enrol(coordinator, "lyon")
    enrol(coordinator, "oslo")
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])

    def site_http(settings: object) -> httpx.Client:
        return httpx.Client(transport=coordinator._transport, base_url=str(coordinator.base_url), headers=headers)

    monkeypatch.setattr(cli_approvals, "site_http", site_http)
    return config, headers


def site(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["site", *args])
    return result.exit_code, result.output


def test_operator_declines_with_the_reviewed_digest_and_a_reason(
    site_config: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, _ = site_config
    study_id = create_study(coordinator, list(SITES))
    (row,) = json.loads(site("studies", "--config", str(config), "--json")[1])
    digest = row["digest"]
    flags = ("--config", str(config), "--reason", REASON)
    code, text = site("decline", str(study_id), *flags, "--digest", "a" * 64)
    assert code == 1 and "not the" in text  # not what the operator reviewed: nothing recorded
    assert approvals_of(coordinator, study_id)["lyon"] == "not reported"
    assert site("decline", str(study_id), "--config", str(config), "--digest", digest)[0] == 2  # no reason

    code, text = site("decline", str(study_id), *flags, "--digest", digest)
    assert code == 0 and f"declined study {study_id}" in text, text
    assert approvals_of(coordinator, study_id)["lyon"] == "declined"
    (row,) = json.loads(site("studies", "--config", str(config), "--json")[1])
    assert row["approval"].startswith("declined by operator ") and row["approval"].endswith(REASON)
    code, text = site("studies", "--config", str(config))
    assert code == 0 and "declined by operator " in text and REASON in text and "approve with:" in text
    code, text = site("decline", str(study_id), *flags, "--digest", digest)
    assert code == 0 and "already declined" in text

    code, text = site("approve", str(study_id), "--config", str(config), "--digest", digest)
    assert code == 0 and "approved study" in text, text  # an approval replaces the decline
    assert approvals_of(coordinator, study_id)["lyon"] == "approved"
    code, text = site("decline", str(study_id), *flags, "--yes")
    assert code == 0 and approvals_of(coordinator, study_id)["lyon"] == "declined"
    code, text = site("revoke-approval", str(study_id), "--config", str(config))
    assert code == 1 and "no recorded approval" in text  # the decline revoked it
