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
from shared.privacy.discrete import DiscreteGaussian
from shared.study import dp as study_dp
from shared.study.accounting import dp_accounting, epsilon_after, privacy_report, trained_rounds
from shared.study.checks import checked_terms
from shared.study.dp import grid_change, norm_bound
from shared.tensors.codec import load
from shared.terms import StudyTerms, TermsError
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
    monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda _key: DiscreteGaussian(b"\x07" * 32))


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
        ({"privacy": {"dp": {**DP, "mode": "distributed"}}}, "distributed noise needs secure_aggregation"),
        ({"privacy": {"dp": {**DP, "noise_multiplier": 900, "clip_norm": 9e5}}}, "beyond the sampler's 2\\^40"),
        (
            {"privacy": {"dp": DP, "secure_aggregation": {"ring_bits": 64}}, "min_sites": 2},
            "set ring_bits = 32",
        ),
        (
            {"privacy": {"dp": {**DP, "clip_norm": 40.0}, "secure_aggregation": {}}, "min_sites": 2},
            "beyond the 32-bit ring's 64",
        ),
    ],
)
def test_a_study_that_dp_cannot_protect_is_refused(changes: dict, message: str) -> None:
    values = config(privacy={"dp": DP}) | changes
    with pytest.raises((ValidationError, TermsError), match=message):
        checked_terms(values)


def accounting_of(values: dict):  # noqa: ANN201
    accounting = dp_accounting(StudyTerms.model_validate(values))
    assert accounting is not None
    return accounting


def test_the_budget_sets_how_many_rounds_train() -> None:
    terms = StudyTerms.model_validate(config(privacy={"dp": DP}, rounds=50))
    assert trained_rounds(terms) == 50
    spent = [epsilon_after(accounting_of(config(privacy={"dp": DP})), t) for t in (1, 2, 3)]
    assert spent == sorted(spent) and spent[0] > 0
    budgeted = config(privacy={"dp": {**DP, "epsilon_budget": (spent[1] + spent[2]) / 2}}, rounds=50)
    assert trained_rounds(StudyTerms.model_validate(budgeted)) == 2


def test_the_pld_accountant_is_refused_for_discrete_noise(coordinator: TestClient) -> None:
    for name in SITES:
        enrol(coordinator, name)
    values = config(privacy={"dp": {**DP, "accountant": "pld"}})
    refused = coordinator.post("/api/v1/studies", json={"name": "t", "config": values}, headers=ADMIN)
    assert refused.status_code == 422 and "accountant = rdp" in refused.text


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
        size = sum(previous[n].numel() for n in floating(previous))
        bound = float(norm_bound(DP["clip_norm"], size, 24))  # Delta in grid steps: C 2^24 + ceil(sqrt d) / 2
        for upload in sent:  # every site's change, read back on the grid, is within the bound of C
            steps = [grid_change(upload[n], previous[n], 24).double() for n in floating(previous)]
            assert math.sqrt(sum(float(s.square().sum()) for s in steps)) <= bound
            assert norm(upload, previous) <= DP["clip_norm"] * (1 + 1e-3)
        residual = np.concatenate(
            [
                (released[n].double() - sum(u[n].double() for u in sent) / len(sent)).reshape(-1).numpy()
                for n in floating(released)
            ]
        )
        expected = DP["noise_multiplier"] * bound * 2.0**-24 / len(sent)  # z Delta on the sum, over the count
        assert abs(residual.std() / expected - 1) < 0.05 and abs(residual.mean()) < 4 * expected / math.sqrt(
            residual.size
        )
    rounds = coordinator.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    accounting = accounting_of(config(privacy={"dp": DP}))
    shown = {r["number"]: r["pooled"].get("privacy") for r in rounds if r["kind"] == "train"}
    assert {t: p["epsilon"] for t, p in shown.items()} == {t: epsilon_after(accounting, t) for t in (1, 2)}
    assert study["privacy"]["epsilon"] == epsilon_after(accounting, 2) and study["privacy"]["delta"] == 1e-5
    assert study["privacy"]["mechanism"] == "discrete Gaussian"


def test_a_budget_below_the_studys_rounds_is_refused_at_creation_naming_what_fits(
    coordinator: TestClient, site_data: dict[str, SiteData]
) -> None:
    accounting = accounting_of(config(privacy={"dp": DP}))
    for name in SITES:
        enrol(coordinator, name)
    budget = (epsilon_after(accounting, 1) + epsilon_after(accounting, 2)) / 2
    refused = coordinator.post(
        "/api/v1/studies",
        json={"name": "t", "config": config(rounds=3, privacy={"dp": {**DP, "epsilon_budget": budget}})},
        headers=ADMIN,
    )
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "privacy_budget"
    detail = refused.text
    assert f"{epsilon_after(accounting, 3):.4g}" in detail and "1 rounds fit" in detail and "replace-one" in detail
    fits = {"name": "t", "config": config(rounds=1, privacy={"dp": {**DP, "epsilon_budget": budget}})}
    assert coordinator.post("/api/v1/studies", json=fits, headers=ADMIN).status_code == 201


def test_the_coordinators_epsilon_cap_refuses_studies_without_dp_or_above_it(tmp_path: Path) -> None:
    from coordinator.main import create_app
    from shared.study.survey import survey_epsilon, survey_sigma
    from tests.conftest import coordinator_settings_for, create_tables

    url = f"sqlite:///{tmp_path / 'capped.db'}"
    create_tables(url)
    accounting = accounting_of(config(privacy={"dp": DP}))
    cap = (epsilon_after(accounting, 1) + epsilon_after(accounting, 2)) / 2
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
        # a survey releases counts: under the cap only noised, and within it (an evaluation releases no model)
        exact = create({"kind": "survey", "sites": SITES})
        assert exact.status_code == 422 and "only noised surveys" in exact.text
        sigma = survey_sigma(cap, 1e-6)
        loud = create({"kind": "survey", "sites": SITES, "survey": {"noise_sigma": sigma / 2}})
        assert loud.status_code == 422 and f"{survey_epsilon(sigma / 2, 1e-6):.4g}" in loud.text
        assert create({"kind": "survey", "sites": SITES, "survey": {"noise_sigma": sigma}}).status_code == 201


def test_epsilon_is_accounted_under_replace_one_with_sensitivity_2_delta() -> None:
    """Discrete noise z Delta against a sensitivity of 2 Delta: the Gaussian's RDP at z / 2 (z = 1, T = 50, 1e-5)."""
    import dp_accounting
    from dp_accounting import rdp

    values = config(privacy={"dp": {**DP, "noise_multiplier": 1.0}}, rounds=50)
    accounting = accounting_of(values)
    replace_one = epsilon_after(accounting, 50)
    oracle = rdp.RdpAccountant()  # dp-accounting's own Gaussian at noise multiplier z / 2, composed 50 times
    oracle.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), 50))
    assert replace_one == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-12)
    assert replace_one == pytest.approx(166.0, abs=0.1)
    # the RDP at order a is a (2 Delta)^2 / (2 sigma^2) = 2a / z^2; over T rounds the classic conversion
    # eps = min_a T * 2a / z^2 + log(1/delta) / (a - 1) bounds the accountant's from above
    orders = np.linspace(1.01, 200, 100_000)
    classic = float(np.min(50 * 2 * orders + math.log(1e5) / (orders - 1)))
    assert replace_one <= classic and replace_one > 0.9 * classic
    report = privacy_report(StudyTerms.model_validate(values), 50)
    assert report is not None and report["relation"] == "replace-one" and report["accountant"] == "rdp"
    size = accounting.dimension
    assert report["sensitivity"] == 2 * (DP["clip_norm"] + (math.isqrt(size - 1) + 1) / 2 * 2.0**-24)


# -- the runner is the service ------------------------------------------------------------------------------


def test_the_runner_releases_the_same_models_as_the_service_with_the_same_noise(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, seeded_noise: None
) -> None:
    """Central noise in a plain study (secure studies, both modes: tests/site_agent/test_secure_rounds.py)."""
    values = config(privacy={"dp": DP})
    study_id, _ = run_service(coordinator, site_data, tmp_path, values)
    study = StudyTerms.model_validate(values)
    outcomes = list(simulate_study(study, site_data, CPU))
    for t in (1, 2):
        service = model(coordinator, study_id, t)
        ours = outcomes[t - 1].global_model
        assert ours.keys() == service.keys()
        assert all(torch.equal(ours[n], service[n]) for n in ours), f"round {t} differs"


def central_average(dp: object, previous: dict, updates: list[dict]) -> dict[str, torch.Tensor]:
    average = study_dp.CentralNoiseAverage(dp)  # type: ignore[arg-type]
    assert average.previous is not None
    average.previous.add(previous, 1.0)
    for update in updates:
        average.add(update, 1.0)
    return average.result()


def test_the_coordinators_noise_is_fresh_discrete_and_of_the_stated_variance() -> None:
    """Anyone who knows the study's seed could subtract seeded noise: the server's comes from the OS."""
    dp = StudyTerms.model_validate(config(privacy={"dp": DP})).privacy.dp
    assert dp is not None
    zeros = {"w": torch.zeros(40_000, dtype=torch.float64), "steps": torch.tensor(3)}
    released = [central_average(dp, zeros, [zeros]) for _ in range(2)]
    assert not torch.equal(released[0]["w"], released[1]["w"])
    assert torch.equal(released[0]["steps"], torch.tensor(3))  # integer tensors are released as they are
    steps = released[0]["w"] * 2**24  # theta^g_{t-1} + noise 2^-24 / 1: whole grid steps, nothing finer
    assert torch.equal(steps, torch.round(steps))
    sigma = DP["noise_multiplier"] * float(norm_bound(DP["clip_norm"], 40_000, 24))
    assert float(steps.std()) == pytest.approx(sigma, rel=0.02)


def test_an_update_beyond_its_clipping_bound_fails_the_aggregation() -> None:
    """A site that did not clip would raise the sensitivity: the coordinator refuses to release its sum."""
    from shared.errors import AggregationError

    dp = StudyTerms.model_validate(config(privacy={"dp": DP})).privacy.dp
    zeros = {"w": torch.zeros(100)}
    with pytest.raises(AggregationError, match="update 2 of the round"):
        central_average(dp, zeros, [zeros, {"w": torch.full((100,), DP["clip_norm"])}])
