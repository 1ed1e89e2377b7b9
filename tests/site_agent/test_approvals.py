"""The data owner decides: a site trains only for studies whose description its operator approved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from shared.privacy.signing import SiteIdentity, fingerprint
from shared.study.description import describe, describe_study
from shared.terms import StudyTerms
from shared.wire.protocol import PROTOCOL_VERSION, StudyOffer, TaskSpec
from site_agent.approvals import Approvals
from site_agent.cli import approvals as cli_approvals
from site_agent.client import CoordinatorClient
from site_agent.config import load_settings, open_store, store_key
from site_agent.data import SiteData
from site_agent.store import SiteStore, StaleStore, generate_key
from site_agent.worker import SiteWorker
from tests.coordinator.factories import ADMIN, approve, create_study, enrol, offer
from tests.site_agent.test_agent import SITES, Recorder, make_worker, site_data
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals", "site_data"]

runner = CliRunner()
TRAINING = {"lr": 0.05, "batch_size": 8, "max_steps": 2}


def started(coordinator: TestClient, **changes: object) -> int:
    """A running study over SITES (enrolled beforehand), tiny model; its id."""
    study_id = create_study(coordinator, list(SITES), training=TRAINING, seed=5, **changes)
    assert coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    return study_id


def status_line(coordinator: TestClient, study_id: int) -> dict:
    report = coordinator.get("/api/v1/status", headers=ADMIN).json()
    return next(line for line in report["studies"] if line["id"] == study_id)


def approvals_of(coordinator: TestClient, study_id: int) -> dict[str, str]:
    return coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["approvals"]


def worker_for(
    coordinator: TestClient, name: str, headers: dict[str, str], tmp_path: Path, data: SiteData, *, auto: bool
) -> tuple[SiteWorker, Recorder]:
    worker, recorder = make_worker(coordinator, name, headers, tmp_path / name, generate_key(), data)
    worker.approvals.auto_approve = auto
    return worker, recorder


def uploads(recorder: Recorder) -> list[str]:
    return [url for url, _ in recorder.bodies if url.endswith("/updates")]


# -- the coordinator mirrors what sites report ---------------------------------------------------------


def test_a_site_that_has_not_approved_gets_no_task_and_is_shown_as_such(coordinator: TestClient) -> None:
    headers = {name: enrol(coordinator, name) for name in SITES}
    study_id = started(coordinator)
    assert approvals_of(coordinator, study_id) == {"lyon": "not reported", "oslo": "not reported"}
    for site_headers in headers.values():  # selected for round 1, but not approved: nothing to do
        assert coordinator.get("/api/v1/tasks/next", headers=site_headers).status_code == 204

    approve(coordinator, headers["lyon"], study_id)
    approve(coordinator, headers["oslo"], study_id, state="awaiting_approval")
    assert approvals_of(coordinator, study_id) == {"lyon": "approved", "oslo": "awaiting approval"}
    assert status_line(coordinator, study_id)["awaiting_approval"] == ["oslo"]
    sites = {s["name"]: s for s in coordinator.get("/api/v1/status", headers=ADMIN).json()["sites"]}
    assert sites["lyon"]["current_task"]["study_id"] == study_id and sites["oslo"]["current_task"] is None
    task = coordinator.get("/api/v1/tasks/next", headers=headers["lyon"])
    assert task.status_code == 200 and task.json()["study_id"] == study_id
    assert coordinator.get("/api/v1/tasks/next", headers=headers["oslo"]).status_code == 204

    audit = coordinator.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    assert {e["action"] for e in audit} >= {"site.approved", "site.awaiting_approval"}


def test_a_site_reports_only_on_studies_that_list_it_with_a_digest(coordinator: TestClient) -> None:
    lyon, oslo = enrol(coordinator, "lyon"), enrol(coordinator, "oslo")
    only_lyon = create_study(coordinator, ["lyon"])
    body = {"state": "approved", "digest": "0" * 64}
    refused = coordinator.put(f"/api/v1/sites/me/studies/{only_lyon}/approval", json=body, headers=oslo)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_a_participant"
    unknown = coordinator.put("/api/v1/sites/me/studies/999/approval", json=body, headers=lyon)
    assert unknown.status_code == 403 and unknown.json()["error"]["code"] == "not_a_participant"
    for bad in ({"state": "approved", "digest": "xyz"}, {"state": "maybe", "digest": "0" * 64}, {"state": "approved"}):
        response = coordinator.put(f"/api/v1/sites/me/studies/{only_lyon}/approval", json=bad, headers=lyon)
        assert response.status_code == 422, bad
    listed = coordinator.get("/api/v1/sites/me/studies", headers=oslo).json()
    assert listed == {"data": [], "count": 0}
    researcher_put = coordinator.put(f"/api/v1/sites/me/studies/{only_lyon}/approval", json=body, headers=ADMIN)
    assert researcher_put.status_code == 403


def test_the_offer_carries_what_the_site_needs_and_what_it_last_reported(coordinator: TestClient) -> None:
    lyon = enrol(coordinator, "lyon")
    study_id = create_study(coordinator, ["lyon"], rounds=4, keep_updates=True, privacy={"min_records": 30})
    first = offer(coordinator, lyon, study_id)
    terms = first.terms
    assert (first.status, terms.rounds, terms.keep_updates, terms.privacy.min_records) == ("draft", 4, True, 30)
    assert first.protocol == PROTOCOL_VERSION and first.approval is None and terms.sites == ["lyon"]
    assert first.site == "lyon"
    assert set(StudyOffer.model_fields).isdisjoint(StudyTerms.model_fields)  # the offer embeds the terms whole
    digest = approve(coordinator, lyon, study_id)
    assert offer(coordinator, lyon, study_id).approval.model_dump() == {"state": "approved", "digest": digest}
    assert coordinator.post(f"/api/v1/studies/{study_id}/cancel", headers=ADMIN).status_code == 200
    assert coordinator.get("/api/v1/sites/me/studies", headers=lyon).json()["count"] == 0  # ended: only with finished
    assert offer(coordinator, lyon, study_id).status == "cancelled"


# -- the digest is the site's own ------------------------------------------------------------------------


# One change of every field of the terms (each top-level field at least once, nested ones too).
TERMS_CHANGES: dict[str, dict] = {
    "sites": {"sites": ["lyon", "oslo"]},
    "model": {"model": {"preset": "tiny", "heads": "4:4"}},
    "labels": {},  # one value in this release: a change is refused (tests/shared/test_terms.py)
    "training": {"training": {"lr": 0.2}},
    "algorithm": {"algorithm": {"name": "fedprox", "params": {"mu": 0.1}}},
    "aggregation": {"aggregation": {"name": "uncertainty", "params": {}}},
    "participation": {"participation": {"name": "random", "params": {"p": 0.5}}},
    "rounds": {"rounds": 3},
    "min_sites": {"sites": ["lyon", "oslo"], "min_sites": 2},
    "round_deadline_s": {"round_deadline_s": 61.0},
    "round_retries": {"round_retries": 3},
    "seed": {"seed": 1},
    "keep_updates": {"keep_updates": True},
    "privacy": {"privacy": {"min_records": 21}},
    "privacy.dp": {"aggregation": {"name": "equal"}, "privacy": {"dp": {"noise_multiplier": 1.0, "clip_norm": 1.0}}},
    "privacy.secure_aggregation": {
        "sites": ["lyon", "oslo"],
        "min_sites": 2,
        "privacy": {"secure_aggregation": {"fraction_bits": 20}},
    },
    "kind": {"kind": "survey"},
    "survey": {"kind": "survey", "survey": {"noise_sigma": 10.0}},
    "evaluation": {
        "kind": "evaluate",
        "evaluation": {"study_uid": "a" * 32, "model_sha256": "b" * 64, "initial_local_sha256": "c" * 64, "rounds": 3},
    },
    "validation_sites": {"validation_sites": ["oslo"]},
    "validation_every": {"validation_sites": ["oslo"], "validation_every": 2},
    "buffered": {"buffered": {"buffer_size": 1}},
}


def test_the_digest_changes_with_every_field_of_the_terms(coordinator: TestClient) -> None:
    lyon = enrol(coordinator, "lyon")
    enrol(coordinator, "oslo")
    base = offer(coordinator, lyon, create_study(coordinator, ["lyon"]))
    digest = describe_study(base, "lyon").digest()
    assert {name.split(".")[0] for name in TERMS_CHANGES} == set(StudyTerms.model_fields)
    for field, change in TERMS_CHANGES.items():
        if not change:
            continue
        terms = base.terms.model_dump(mode="json")
        for key, value in change.items():
            terms[key] = {**terms.get(key, {}), **value} if isinstance(value, dict) and key != "model" else value
        changed = StudyOffer.model_validate({**base.model_dump(mode="json"), "terms": terms})
        assert describe_study(changed, "lyon").digest() != digest, field
    for field, value in {"protocol": base.protocol + 1, "study_uid": "f" * 32}.items():
        changed = StudyOffer.model_validate({**base.model_dump(mode="json"), field: value})
        assert describe_study(changed, "lyon").digest() != digest, field
    assert describe_study(base, "oslo").digest() != digest  # each site approves its own description
    renamed = StudyOffer.model_validate({**base.model_dump(mode="json"), "name": "other", "status": "running"})
    assert describe_study(renamed, "lyon").digest() == digest  # what the coordinator calls it is not what runs


def test_uncertainty_studies_say_that_the_entropy_leaves_the_site(coordinator: TestClient) -> None:
    lyon = enrol(coordinator, "lyon")
    plain = describe_study(offer(coordinator, lyon, create_study(coordinator, ["lyon"])), "lyon")
    weighted = create_study(coordinator, ["lyon"], aggregation={"name": "uncertainty", "params": {}})
    description = describe_study(offer(coordinator, lyon, weighted), "lyon")
    assert any("entropy" in line for line in description.statistics)
    assert not any("entropy" in line for line in plain.statistics)
    names = {t.name for t in description.uploads}
    assert names and not names & set(description.kept_local)  # what leaves and what stays are disjoint
    assert not any(name.startswith("blocks.0.local_branch.in_proj") for name in names)  # the H_l heads stay


# -- the agent declines, reports, and trains once approved -----------------------------------------------


def test_the_agent_declines_until_its_operator_approves(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    headers = {name: enrol(coordinator, name) for name in SITES}
    study_id = started(coordinator, rounds=1)
    lyon, lyon_wire = worker_for(coordinator, "lyon", headers["lyon"], tmp_path, site_data["lyon"], auto=False)
    oslo, _ = worker_for(coordinator, "oslo", headers["oslo"], tmp_path, site_data["oslo"], auto=True)

    assert not lyon.poll_once()  # reported "awaiting approval"; the coordinator offered it nothing
    assert approvals_of(coordinator, study_id) == {"lyon": "awaiting approval", "oslo": "not reported"}
    assert oslo.poll_once()  # auto_approve (demos, tests): approved, trained and uploaded
    assert approvals_of(coordinator, study_id)["oslo"] == "approved"
    assert uploads(lyon_wire) == []

    current = next(o for o in lyon.client.offers() if o.study_id == study_id)
    lyon.approvals.approve(current, by="operator test")
    assert lyon.poll_once()  # reports the approval, then gets and trains round 1
    assert approvals_of(coordinator, study_id)["lyon"] == "approved"
    assert len(uploads(lyon_wire)) == 1
    record = lyon.store.load_approval(f"{study_id}-{current.study_uid}")
    assert record["digest"] == describe_study(current, "lyon").digest() and record["approved_by"] == "operator test"
    assert record["description"]["terms"] == current.terms.model_dump(mode="json")  # what each round is built from


def test_a_task_unlike_the_approved_terms_is_declined(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    """A coordinator cannot slip other terms into a task: the site declines it, says why, and sends nothing else."""
    headers = {name: enrol(coordinator, name) for name in SITES}
    study_id = started(coordinator, rounds=2)
    lyon, wire = worker_for(coordinator, "lyon", headers["lyon"], tmp_path, site_data["lyon"], auto=False)
    approved = next(o for o in lyon.client.offers() if o.study_id == study_id)
    lyon.approvals.approve(approved, by="operator test")
    lyon.approvals.sync(lyon.client)
    task = lyon.client.next_task()
    assert task is not None
    terms = task.terms.model_dump(mode="json")
    for change in ({"training": {**terms["training"], "lr": 1.0}}, {"keep_updates": True}):
        hostile = TaskSpec.model_validate({**task.model_dump(mode="json"), "terms": {**terms, **change}})
        lyon.handle(hostile)
        assert uploads(wire) == []
    assert approvals_of(coordinator, study_id)["lyon"] == "approved"  # a task changes no approval
    audit = coordinator.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    (declined,) = [event for event in audit if event["action"] == "task.declined"]
    assert declined["round_id"] == task.round_id and "training.lr" in declined["detail"]["reason"]
    assert coordinator.get("/api/v1/tasks/next", headers=headers["lyon"]).status_code == 204  # not offered again


def test_a_revoked_approval_stops_training_and_keeps_a_pending_upload_unsent(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    headers = {name: enrol(coordinator, name) for name in SITES}
    study_id = started(coordinator, rounds=3)
    lyon, wire = worker_for(coordinator, "lyon", headers["lyon"], tmp_path, site_data["lyon"], auto=False)
    current = next(o for o in lyon.client.offers() if o.study_id == study_id)
    lyon.approvals.approve(current, by="operator test")
    assert lyon.poll_once()
    assert lyon.approvals.revoke(study_id, current.study_uid)
    assert not lyon.poll_once()
    assert approvals_of(coordinator, study_id)["lyon"] == "awaiting approval"
    assert len(uploads(wire)) == 1


def test_a_new_agent_store_refuses_approvals_under_another_key(tmp_path: Path, coordinator: TestClient) -> None:
    """Approvals live in the encrypted store: another key cannot read (or forge) them."""
    lyon = enrol(coordinator, "lyon")
    study_id = create_study(coordinator, ["lyon"])
    store = SiteStore(tmp_path / "store", generate_key(), "lyon")
    Approvals(store).approve(offer(coordinator, lyon, study_id), by="operator")
    (key,) = store.approved_studies()
    raw = (tmp_path / "store" / "approvals" / f"{key}.enc").read_bytes()
    assert b"digest" not in raw and b"operator" not in raw
    other = SiteStore(tmp_path / "other", generate_key(), "lyon")
    (tmp_path / "other" / "approvals").mkdir()
    (tmp_path / "other" / "approvals" / f"{key}.enc").write_bytes(raw)
    with pytest.raises(Exception, match="failed authentication"):
        other.load_approval(key)


# -- the operator's commands ------------------------------------------------------------------------------


@pytest.fixture()
def site_config(tmp_path: Path, coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict]:
    """Site lyon's config, its commands talking to the in-process coordinator; (config, lyon's headers)."""
    headers = enrol(coordinator, "lyon")
    enrol(coordinator, "oslo")
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    monkeypatch.setattr(
        cli_approvals,
        "site_http",
        lambda settings: httpx.Client(
            transport=coordinator._transport, base_url=str(coordinator.base_url), headers=headers
        ),
    )
    return config, headers


def site(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["site", *args])
    return result.exit_code, result.output


def test_operator_lists_reviews_approves_and_revokes(site_config: tuple[Path, dict], coordinator: TestClient) -> None:
    config, headers = site_config
    study_id = create_study(coordinator, list(SITES), aggregation={"name": "uncertainty", "params": {}})
    code, listing = site("studies", "--config", str(config), "--json")
    assert code == 0, listing
    (row,) = json.loads(listing)
    assert row["study_id"] == study_id and row["approval"] == "awaiting approval"
    digest = row["digest"]
    assert digest == describe_study(offer(coordinator, headers, study_id), "lyon").digest()

    code, text = site("studies", "--config", str(config))
    assert code == 0 and "awaiting approval" in text and digest in text and "entropy" in text
    assert f"cardiofl site approve {study_id} --config {config} --digest {digest}" in text

    code, text = site("approve", str(study_id), "--config", str(config), "--digest", "a" * 64)
    assert code == 1 and "not the" in text  # not what the operator reviewed: nothing recorded
    assert approvals_of(coordinator, study_id)["lyon"] == "not reported"

    code, text = site("approve", str(study_id), "--config", str(config), "--digest", digest)
    assert code == 0 and "approved study" in text, text
    assert approvals_of(coordinator, study_id)["lyon"] == "approved"
    assert json.loads(site("studies", "--config", str(config), "--json")[1])[0]["approval"] == "approved"

    code, text = site("revoke-approval", str(study_id), "--config", str(config))
    assert code == 0, text
    assert approvals_of(coordinator, study_id)["lyon"] == "awaiting approval"
    code, text = site("revoke-approval", str(study_id), "--config", str(config))
    assert code == 1 and "no recorded approval" in text


def test_an_older_copy_of_the_store_restored_after_a_revocation_stops_the_agent(
    site_config: tuple[Path, dict], coordinator: TestClient, tmp_path: Path
) -> None:
    config, _ = site_config
    study_id = create_study(coordinator, list(SITES))
    assert site("approve", str(study_id), "--config", str(config), "--yes")[0] == 0
    shutil.copytree(tmp_path / "store", tmp_path / "backup")  # taken while the study was approved
    assert site("revoke-approval", str(study_id), "--config", str(config))[0] == 0
    shutil.rmtree(tmp_path / "store")
    shutil.copytree(tmp_path / "backup", tmp_path / "store")  # restored: the revoked approval is back

    result = runner.invoke(app, ["site", "run", "--config", str(config)])
    assert result.exit_code == 3 and "an older copy of the store" in result.stderr, result.output
    assert "store.key.approvals-version records 2" in result.stderr  # kept beside the key file
    code, text = site("approve", str(study_id), "--config", str(config), "--yes")
    assert code == 3 and "was restored" in text
    settings = load_settings(config)
    with pytest.raises(StaleStore, match="its approvals are at version 1"):
        open_store(settings, store_key(settings))
    assert approvals_of(coordinator, study_id)["lyon"] == "awaiting approval"


def test_the_agents_auto_approval_moves_the_version_on(coordinator: TestClient, tmp_path: Path) -> None:
    lyon = enrol(coordinator, "lyon")
    study_id = create_study(coordinator, ["lyon"])
    store = SiteStore(tmp_path / "store", generate_key(), "lyon", version_file=tmp_path / "version")
    assert Approvals(store, auto_approve=True).decide(offer(coordinator, lyon, study_id)).approved
    assert store.approvals_version() == (1, store.approved_studies()) and store.recorded_version() == 1


def test_approve_asks_before_it_records(site_config: tuple[Path, dict], coordinator: TestClient) -> None:
    config, _ = site_config
    study_id = create_study(coordinator, list(SITES))
    result = runner.invoke(app, ["site", "approve", str(study_id), "--config", str(config)], input="n\n")
    assert result.exit_code == 1 and "Approve this study?" in result.output
    assert approvals_of(coordinator, study_id)["lyon"] == "not reported"
    code, text = site("approve", "999", "--config", str(config), "--yes")
    assert code == 1 and "does not list this site" in text


def test_a_worker_without_auto_approve_is_the_default(coordinator: TestClient, tmp_path: Path) -> None:
    http = httpx.Client(transport=coordinator._transport, base_url=str(coordinator.base_url))
    worker = SiteWorker(
        site="lyon",
        client=CoordinatorClient(http),
        store=SiteStore(tmp_path / "store", generate_key(), "lyon"),
        data=lambda: None,  # type: ignore[arg-type, return-value]
        runtime=None,  # type: ignore[arg-type]
    )
    assert worker.approvals.auto_approve is False


def test_the_operator_sees_the_adversary_and_every_signing_keys_fingerprint() -> None:
    keys = {name: SiteIdentity.generate().public_hex() for name in ("lyon", "oslo", "porto", "rome")}
    terms = StudyTerms.model_validate(
        {
            "sites": sorted(keys),
            "min_sites": 4,
            "privacy": {"secure_aggregation": {"site_keys": keys}},
            "model": {"preset": "tiny"},
        }
    )
    text = "\n".join(cli_approvals.describe_lines(describe(terms, study_uid="u" * 32, site="lyon", protocol=5)))
    assert "colluding with up to 1 site(s)" in text  # (K - 1) // 3 of four sites
    assert "a round of 4 sites: shares with every other site, threshold 3, 3 consistency signatures, at least " in text
    assert "4 survivors (0 may drop)" in text and "a model served again is refused" in text
    for name, key in keys.items():
        assert f"{name} {fingerprint(key)}" in text
    raw = terms.model_dump(mode="json")
    raw["privacy"]["secure_aggregation"]["colluding"] = 2
    explicit = StudyTerms.model_validate(raw)
    text = "\n".join(cli_approvals.describe_lines(describe(explicit, study_uid="u" * 32, site="lyon", protocol=5)))
    assert "colluding with up to 2 site(s)" in text
