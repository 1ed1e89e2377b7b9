"""A buffered study through the service with real site workers equals the runner replaying its audit trail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from cardiofl.experiment.buffered import Buffer
from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.runner import load_sites, simulate_study
from shared.privacy.discrete import DiscreteGaussian
from shared.study import dp as study_dp
from shared.tensors.codec import load
from shared.terms import StudyTerms
from site_agent.device import resolve_runtime
from site_agent.store import generate_key
from site_agent.worker import SiteWorker
from tests.coordinator.factories import ADMIN, enrol
from tests.site_agent.test_agent import make_worker

CPU = resolve_runtime("cpu")


def _study(tmp_path: Path, dp: bool) -> tuple[StudyTerms, ExperimentConfig]:
    private = {"dp": {"noise_multiplier": 1.1, "clip_norm": 0.05, "mode": "central"}} if dp else {}
    config = ExperimentConfig.model_validate(
        {
            "name": "buffered-service",
            "preset": "tiny",
            "heads": ["6:2"],
            "seeds": [3],
            "rounds": 5,
            "synthetic": {"sites": 4, "records_per_site": 30, "seed": 5},
            "training": {"optimizer": "sgd", "lr": 0.05, "batch_size": 8, "max_steps": 2},
            "privacy": {"min_records": 3, **private},
            "methods": [
                {
                    "label": "FedBuff",
                    "buffered": {"buffer_size": 2, "max_staleness": 1},
                    "aggregation": {"name": "equal" if dp else "samples"},
                }
            ],
            "device": "cpu",
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    return config.study(config.runs()[0]), config


@pytest.mark.parametrize("dp", [False, True], ids=["plain", "central-dp"])
def test_the_runner_replaying_the_audit_trail_gives_the_service_s_versions_bit_for_bit(
    coordinator: TestClient, tmp_path: Path, dp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if dp:  # every release's noise from one fixed key: the service and the runner then draw the same numbers
        monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda _key: DiscreteGaussian(b"\x07" * 32))
    study, config = _study(tmp_path, dp)
    data = load_sites(config)
    workers = {
        name: make_worker(coordinator, name, enrol(coordinator, name), tmp_path / name, generate_key(), data[name])[0]
        for name in study.sites
    }
    created = coordinator.post(
        "/api/v1/studies", json={"name": "fedbuff", "config": study.model_dump(mode="json")}, headers=ADMIN
    ).json()
    coordinator.post(f"/api/v1/studies/{created['id']}/start", headers=ADMIN)
    one, two, three, four = (workers[f"site-{i}"] for i in range(1, 5))

    def poll(worker: SiteWorker) -> None:
        assert worker.poll_once()

    four.approvals.sync(four.client)
    slow = four.client.next_task()  # site-4 is tasked in round 1 and comes back two releases later
    assert slow is not None and slow.round == 1
    poll(one), poll(two)  # buffer 1: site-1, site-2 from version 0
    poll(three), poll(one)  # buffer 2: site-1, site-3 from version 1
    four.handle(slow)  # two versions behind the open buffer 3's base: refused, its phi_k not committed
    refused = [e for e in _audit(coordinator, created["id"]) if e["action"] == "update.refused"]
    assert [e["detail"]["code"] for e in refused] == ["update_too_stale"]
    two.approvals.sync(two.client)
    late = two.client.next_task()  # site-2 tasked in round 3, arriving after its release
    assert late is not None and late.round == 3
    poll(four), poll(three)  # buffer 3: site-3, site-4 from version 2
    two.handle(late)  # one version behind: joins buffer 4 against version 2
    poll(one)  # buffer 4: site-1 from 3, site-2 from 2
    poll(one), poll(three)  # buffer 5; then the final evaluation by every site
    for worker in workers.values():
        poll(worker)
    status = coordinator.get(f"/api/v1/studies/{created['id']}", headers=ADMIN).json()["status"]
    assert status == "completed"

    completed = sorted(
        (e["detail"] for e in _audit(coordinator, created["id"]) if e["action"] == "round.completed"),
        key=lambda detail: detail["round"],
    )
    trained = [detail for detail in completed if "bases" in detail]
    assert [d["bases"] for d in trained] == [
        {"site-1": 0, "site-2": 0},
        {"site-1": 1, "site-3": 1},
        {"site-3": 2, "site-4": 2},
        {"site-1": 3, "site-2": 2},
        {"site-1": 4, "site-3": 4},
    ]
    schedule = [Buffer({site: base + 1 for site, base in d["bases"].items()}) for d in trained]
    outcomes = list(simulate_study(study, data, CPU, schedule=schedule))
    for version in range(1, 6):
        served = load(coordinator.get(f"/api/v1/studies/{created['id']}/models/{version}", headers=ADMIN).content)[0]
        ours = outcomes[version - 1].global_model
        different = [n for n in ours if not torch.equal(ours[n], served[n])]
        assert not different, f"version {version}: {len(different)} tensors differ, e.g. {different[:3]}"
        assert outcomes[version - 1].weights == trained[version - 1]["weights"]
    rounds = coordinator.get(f"/api/v1/studies/{created['id']}/rounds", headers=ADMIN).json()["data"]
    if dp:  # epsilon after each release: every site may be in every one
        spent = [r["pooled"]["privacy"]["epsilon"] for r in sorted(rounds, key=lambda r: r["number"])[:5]]
        assert all(0 < a < b for a, b in zip(spent, spent[1:], strict=False)), spent
    final = next(r for r in rounds if r["kind"] == "evaluate")
    record = outcomes[-1].record(study.model.config().n_classes)
    assert {u["site"]: u["local_eval"] for u in final["updates"]} == {
        site: values["local"] for site, values in record["sites"].items()
    }  # each site's phi_k after its last accepted update, as the runner kept it


def _audit(coordinator: TestClient, study_id: int) -> list[dict[str, Any]]:
    return coordinator.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
