"""Client-level differential privacy of studies: clipped uploads, noise of the stated size, epsilon, budget."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

from cardiofl.experiment.runner import simulate_study
from shared.privacy import study_dp
from shared.privacy.dp import SecureGaussian
from shared.privacy.study_dp import epsilon_after, trained_rounds
from shared.tensors import load
from shared.terms import StudyTerms
from site_agent.data import SiteData
from site_agent.device import resolve_runtime
from tests.coordinator.factories import ADMIN, create_study, enrol
from tests.site_agent.test_agent import SITES, Recorder, make_worker, site_data

__all__ = ["site_data"]

CPU = resolve_runtime("cpu")
TRAINING = {"optimizer": "sgd", "lr": 0.05, "batch_size": 8, "max_steps": 2}
DP = {"noise_multiplier": 1.1, "clip_norm": 0.05, "delta": 1e-5}


def config(**changes: object) -> dict:
    return {
        "model": {"preset": "tiny", "heads": "6:2"},
        "aggregation": {"name": "equal"},
        "training": TRAINING,
        "rounds": 2,
        "seed": 3,
        "min_sites": 2,
        "round_deadline_s": 60.0,
        "sites": list(SITES),
        **changes,
    }


@pytest.fixture()
def seeded_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round's noise from one fixed key: the service and the runner then draw the same numbers."""
    monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda: SecureGaussian(b"\x07" * 32))


def run_service(coordinator: TestClient, data: dict[str, SiteData], tmp_path: Path, study: dict) -> tuple[int, dict]:
    """The study through the coordinator's API with one agent per site; (study id, site -> recorder)."""
    wires = {}
    workers = []
    for name in SITES:
        worker, recorder = make_worker(
            coordinator, name, enrol(coordinator, name), tmp_path / name, b"k" * 32, data[name]
        )
        workers.append(worker)
        wires[name] = recorder
    study_id = create_study(coordinator, list(SITES), **{k: v for k, v in study.items() if k != "sites"})
    assert coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    for _ in range(6):
        if coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed":
            break
        for worker in workers:
            worker.poll_once()
    return study_id, wires


def uploads(recorder: Recorder) -> list[dict[str, torch.Tensor]]:
    return [load(body)[0] for url, body in recorder.bodies if url.endswith("/updates")]


def model(coordinator: TestClient, study_id: int, number: int) -> dict[str, torch.Tensor]:
    response = coordinator.get(f"/api/v1/studies/{study_id}/models/{number}", headers=ADMIN)
    return load(response.content)[0]


def floating(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t.is_floating_point()}


def norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[n].double() - b[n].double()).square().sum()) for n in floating(a)))


# -- configuration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"aggregation": {"name": "samples"}}, "aggregation = equal"),
        ({"algorithm": {"name": "scaffold"}}, "uploads other tensors"),
        ({"privacy": {"dp": {**DP, "epsilon_budget": 0.01}}}, "does not allow a single round"),
        ({"privacy": {"dp": {**DP, "noise_multiplier": 0}}}, "greater than 0"),
    ],
)
def test_a_study_that_dp_cannot_protect_is_refused(changes: dict, message: str) -> None:
    values = config(privacy={"dp": DP}) | changes
    with pytest.raises(ValidationError, match=message):
        StudyTerms.model_validate(values)


def test_the_budget_sets_how_many_rounds_train() -> None:
    dp = StudyTerms.model_validate(config(privacy={"dp": DP}, rounds=50)).privacy.dp
    assert dp is not None and trained_rounds(dp, 50) == 50
    spent = [epsilon_after(dp, t) for t in (1, 2, 3)]
    assert spent == sorted(spent) and spent[0] > 0
    budgeted = dp.model_copy(update={"epsilon_budget": (spent[1] + spent[2]) / 2})
    assert trained_rounds(budgeted, 50) == 2


# -- the service -------------------------------------------------------------------------------------------


def test_central_dp_clips_every_upload_and_the_coordinator_adds_the_stated_noise(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    study_id, wires = run_service(coordinator, site_data, tmp_path, config(privacy={"dp": DP}))
    study = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert study["status"] == "completed"
    for t in (1, 2):
        previous, released = model(coordinator, study_id, t - 1), model(coordinator, study_id, t)
        sent = [uploads(wires[name])[t - 1] for name in SITES]
        for upload in sent:  # every site's update is within the clipping norm
            assert norm(upload, previous) <= DP["clip_norm"] * (1 + 1e-4)
        residual = np.concatenate(
            [
                (released[n].double() - sum(u[n].double() for u in sent) / len(sent)).reshape(-1).numpy()
                for n in floating(released)
            ]
        )
        expected = DP["noise_multiplier"] * DP["clip_norm"] / len(sent)  # z C on the sum, over the count
        assert abs(residual.std() / expected - 1) < 0.05 and abs(residual.mean()) < 4 * expected / math.sqrt(
            residual.size
        )
    rounds = coordinator.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    dp = StudyTerms.model_validate(config(privacy={"dp": DP})).privacy.dp
    shown = {r["number"]: r["pooled"].get("privacy") for r in rounds if r["kind"] == "train"}
    assert {t: p["epsilon"] for t, p in shown.items()} == {t: epsilon_after(dp, t) for t in (1, 2)}
    assert study["privacy"]["epsilon"] == epsilon_after(dp, 2) and study["privacy"]["delta"] == 1e-5


def test_distributed_dp_sites_add_their_share_and_the_coordinator_none(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    dp = {**DP, "mode": "distributed"}
    study_id, wires = run_service(coordinator, site_data, tmp_path, config(privacy={"dp": dp}, rounds=1))
    previous, released = model(coordinator, study_id, 0), model(coordinator, study_id, 1)
    sent = [uploads(wires[name])[0] for name in SITES]
    share = DP["noise_multiplier"] * DP["clip_norm"] / math.sqrt(2)  # z C / sqrt(t'), t' = min_sites = 2
    for upload in sent:  # the clipped update (norm <= C) plus the site's noise share
        values = sum(floating(upload)[n].numel() for n in floating(upload))
        assert norm(upload, previous) == pytest.approx(share * math.sqrt(values), rel=0.05)
    for name in floating(released):  # the coordinator only averages
        assert torch.allclose(released[name], (sent[0][name] + sent[1][name]) / 2, atol=1e-6)


def test_a_budget_below_the_studys_rounds_is_refused_at_creation_naming_what_fits(
    coordinator: TestClient, site_data: dict[str, SiteData]
) -> None:
    dp = StudyTerms.model_validate(config(privacy={"dp": DP})).privacy.dp
    assert dp is not None
    for name in SITES:
        enrol(coordinator, name)
    budget = (epsilon_after(dp, 1) + epsilon_after(dp, 2)) / 2
    refused = coordinator.post(
        "/api/v1/studies",
        json={"name": "t", "config": config(rounds=3, privacy={"dp": {**DP, "epsilon_budget": budget}})},
        headers=ADMIN,
    )
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "privacy_budget"
    detail = refused.text
    assert f"{epsilon_after(dp, 3):.4g}" in detail and "1 rounds fit" in detail and "replace-one" in detail
    fits = {"name": "t", "config": config(rounds=1, privacy={"dp": {**DP, "epsilon_budget": budget}})}
    assert coordinator.post("/api/v1/studies", json=fits, headers=ADMIN).status_code == 201


def test_the_coordinators_epsilon_cap_refuses_studies_without_dp_or_above_it(tmp_path: Path) -> None:
    from coordinator.main import create_app
    from tests.conftest import coordinator_settings_for, create_tables

    url = f"sqlite:///{tmp_path / 'capped.db'}"
    create_tables(url)
    dp = StudyTerms.model_validate(config(privacy={"dp": DP})).privacy.dp
    assert dp is not None
    cap = (epsilon_after(dp, 1) + epsilon_after(dp, 2)) / 2
    with TestClient(create_app(coordinator_settings_for(url, max_epsilon=cap))) as capped:
        for name in SITES:
            enrol(capped, name)

        def create(values: dict) -> object:
            return capped.post("/api/v1/studies", json={"name": "t", "config": values}, headers=ADMIN)

        plain = create(config())
        assert plain.status_code == 422 and "only studies with differential privacy" in plain.text
        above = create(config(rounds=2, privacy={"dp": DP}))
        assert above.status_code == 422 and "this coordinator's cap" in above.text
        assert create(config(rounds=1, privacy={"dp": DP})).status_code == 201


def test_epsilon_is_accounted_under_replace_one_with_sensitivity_2c() -> None:
    """Noise z C against a sensitivity of 2 C: the accountant composes z / 2 (z = 1, T = 50, delta = 1e-5)."""
    from shared.privacy.accounting import epsilon_spent

    dp = StudyTerms.model_validate(config(privacy={"dp": {**DP, "noise_multiplier": 1.0}}, rounds=50)).privacy.dp
    assert dp is not None
    replace_one = epsilon_after(dp, 50)
    add_remove = epsilon_spent(noise_multiplier=1.0, sampling_rate=1.0, rounds=50, delta=1e-5)
    assert replace_one == epsilon_spent(noise_multiplier=0.5, sampling_rate=1.0, rounds=50, delta=1e-5)
    assert replace_one == pytest.approx(166.0, abs=0.1) and add_remove == pytest.approx(57.3, abs=0.1)
    # the Gaussian mechanism's RDP at order a is a * Delta^2 / (2 sigma^2) = a * (2C)^2 / (2 (zC)^2) = 2a / z^2;
    # over T rounds the conversion eps = min_a T * 2a / z^2 + log(1/delta) / (a - 1) bounds the accountant's
    orders = np.linspace(1.01, 200, 100_000)
    classic = float(np.min(50 * 2 * orders + math.log(1e5) / (orders - 1)))
    assert replace_one <= classic and replace_one > 0.9 * classic
    report = study_dp.privacy_report(dp, 50)
    assert report is not None and report["relation"] == "replace-one" and report["sensitivity"] == 2 * DP["clip_norm"]


# -- the runner is the service ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_the_runner_releases_the_same_models_as_the_service_with_the_same_noise(
    mode: str, coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, seeded_noise: None
) -> None:
    values = config(privacy={"dp": {**DP, "mode": mode}})
    study_id, _ = run_service(coordinator, site_data, tmp_path, values)
    study = StudyTerms.model_validate(values)
    outcomes = list(simulate_study(study, site_data, CPU))
    for t in (1, 2):
        service = model(coordinator, study_id, t)
        ours = outcomes[t - 1].global_model
        assert ours.keys() == service.keys()
        assert all(torch.equal(ours[n], service[n]) for n in ours), f"round {t} differs"


def test_the_coordinators_noise_is_fresh_every_time_whatever_the_seed() -> None:
    """Anyone who knows the study's seed could subtract seeded noise: the server's comes from the OS."""
    dp = StudyTerms.model_validate(config(privacy={"dp": DP})).privacy.dp
    assert dp is not None
    update = {"w": torch.zeros(10_000), "steps": torch.tensor(3)}
    released = []
    for _ in range(2):
        average = study_dp.CentralNoiseAverage(dp)
        average.add(update, 1.0)
        released.append(average.result())
    assert not torch.equal(released[0]["w"], released[1]["w"])
    assert torch.equal(released[0]["steps"], torch.tensor(3))  # integer tensors are released as they are
    assert float(released[0]["w"].std()) == pytest.approx(DP["noise_multiplier"] * DP["clip_norm"], rel=0.05)
