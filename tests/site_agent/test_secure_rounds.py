"""Secure aggregation end to end: site agents and the coordinator run SecAgg+ through the HTTP API."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from cardiofl.experiment.runner import simulate_study
from coordinator.models import Blob, Update
from shared.privacy.discrete import DiscreteGaussian
from shared.study import dp as study_dp
from shared.study.dp import norm_bound
from shared.study.rules import initial_state, secure_layout, shared_schema
from shared.tensors.codec import load
from shared.terms import StudyTerms
from shared.wire.secure import MASKED_NARROW, MASKED_TENSOR
from site_agent.data import SiteData
from site_agent.device import resolve_runtime
from site_agent.worker import SiteWorker
from tests.coordinator.factories import ADMIN, create_study, enrol
from tests.site_agent.test_agent import SITES, Recorder, make_worker, site_data

__all__ = ["site_data"]

CPU = resolve_runtime("cpu")
TRAINING = {"optimizer": "sgd", "lr": 0.05, "batch_size": 8, "max_steps": 2}


def secure_config(**changes: object) -> dict:
    return {
        "model": {"preset": "tiny", "heads": "6:2"},
        "training": TRAINING,
        "rounds": 2,
        "seed": 5,
        "min_sites": 2,
        "round_deadline_s": 60.0,
        "privacy": {"min_records": 1, "secure_aggregation": {"phase_timeout_s": 30.0}},
        "sites": list(SITES),
        **changes,
    }


def agents(
    coordinator: TestClient, data: dict[str, SiteData], tmp_path: Path
) -> dict[str, tuple[SiteWorker, Recorder]]:
    return {
        name: make_worker(coordinator, name, enrol(coordinator, name), tmp_path / name, b"k" * 32, data[name])
        for name in SITES
    }


def run_study(coordinator: TestClient, workers: dict[str, tuple[SiteWorker, Recorder]], config: dict) -> int:
    for worker, _ in workers.values():  # each agent registers its signing key at its first start
        worker.register_identity()
    study_id = create_study(coordinator, list(SITES), **{k: v for k, v in config.items() if k != "sites"})
    assert coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    for _ in range(40):
        if coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] != "running":
            break
        for worker, _ in workers.values():
            worker.poll_once()
    return study_id


def models(coordinator: TestClient, study_id: int, rounds: int) -> dict[int, dict[str, torch.Tensor]]:
    return {
        t: load(coordinator.get(f"/api/v1/studies/{study_id}/models/{t}", headers=ADMIN).content)[0]
        for t in range(1, rounds + 1)
    }


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_a_secure_study_completes_and_equals_the_runner_bit_for_bit(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, algorithm: str
) -> None:
    config = secure_config(
        algorithm={"name": algorithm, "params": {"server_lr": 0.5} if algorithm == "scaffold" else {}}
    )
    workers = agents(coordinator, site_data, tmp_path)
    study_id = run_study(coordinator, workers, config)
    shown = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert shown["status"] == "completed", shown
    rounds = coordinator.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert [(r["kind"], r["status"]) for r in rounds] == [("train", "completed")] * 2 + [("evaluate", "completed")]
    service = models(coordinator, study_id, 2)

    outcomes = list(simulate_study(StudyTerms.model_validate(config), site_data, CPU))
    for t in (1, 2):
        ours = outcomes[t - 1].global_model
        assert ours.keys() == service[t].keys()
        different = [n for n in ours if not torch.equal(ours[n], service[t][n])]
        assert not different, f"round {t}: {len(different)} tensors differ, e.g. {different[:3]}"
    assert {u["site"]: u["weight"] for u in rounds[0]["updates"]} == outcomes[0].weights
    # the pooled statistics come from the unmasked sum: the same counts as the sites' own
    for t in (2, 3):  # round t's sites evaluated theta^g_{t-1}, shown with round t - 1
        pooled, record = rounds[t - 2]["pooled"]["eval"], outcomes[t - 1].record(20)["previous_global"]
        assert pooled["n_samples"] == record["n_samples"] > 0 and pooled["n_sites"] == 2
        assert pooled["micro_f1"] == pytest.approx(record["micro_f1"], abs=1e-12)
        assert pooled["loss"] == pytest.approx(record["loss"], rel=1e-6)


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_a_secure_dp_study_equals_the_runner_bit_for_bit_with_the_same_noise(
    coordinator: TestClient,
    site_data: dict[str, SiteData],
    tmp_path: Path,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Discrete noise on the grid, in Z_{2^32}: the coordinator's (central) or each site's share (distributed)."""
    draws = itertools.count(1)  # each draw its own key, in the order sites and coordinator draw: independent shares
    monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda _key: DiscreteGaussian(bytes([next(draws)]) * 32))
    dp = {"noise_multiplier": 1.1, "clip_norm": 0.05, "delta": 1e-5, "mode": mode}
    config = secure_config(aggregation={"name": "equal"}, privacy={**secure_config()["privacy"], "dp": dp})
    workers = agents(coordinator, site_data, tmp_path)
    study_id = run_study(coordinator, workers, config)
    shown = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert shown["status"] == "completed", shown
    assert shown["privacy"]["mode"] == mode and shown["privacy"]["mechanism"] == "discrete Gaussian"
    service = models(coordinator, study_id, 2)
    draws = itertools.count(1)  # the runner draws in the same order: sites in turn, then the server
    outcomes = list(simulate_study(StudyTerms.model_validate(config), site_data, CPU))
    terms = StudyTerms.model_validate(config)
    previous = initial_state(terms)[0]
    for t in (1, 2):
        ours = outcomes[t - 1].global_model
        different = [n for n in ours if not torch.equal(ours[n], service[t][n])]
        assert not different, f"round {t}: {len(different)} tensors differ, e.g. {different[:3]}"
        # theta^g_t - theta^g_{t-1} = (sum of the changes on the grid + noise) 2^-24 / 2, up to float32's rounding
        moved = np.concatenate(
            [(ours[n].double() - previous[n].double()).reshape(-1).numpy() for n in ours if ours[n].is_floating_point()]
        )
        sigma = 1.1 * float(norm_bound(0.05, moved.size, 24)) * 2.0**-24 / 2  # z Delta on the sum, over 2 sites
        assert moved.std() == pytest.approx(sigma, rel=0.05)
        previous = ours


@pytest.mark.parametrize(
    "changes",
    [
        {"model": {"preset": "tiny", "heads": "6:2", "site_heads": {"oslo": "3:5"}}},
        {"algorithm": {"name": "learned_heads", "params": {"gate_penalty": 0.01, "probe_epochs": 2}}},
    ],
    ids=["site_heads", "learned_heads"],
)
def test_per_head_weights_are_summed_under_the_masks_and_equal_the_runner(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, changes: dict
) -> None:
    config = secure_config(**changes)
    workers = agents(coordinator, site_data, tmp_path)
    study_id = run_study(coordinator, workers, config)
    assert coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed"
    service = models(coordinator, study_id, 2)
    outcomes = list(simulate_study(StudyTerms.model_validate(config), site_data, CPU))
    for t in (1, 2):
        ours = outcomes[t - 1].global_model
        different = [n for n in ours if not torch.equal(ours[n], service[t][n])]
        assert ours.keys() == service[t].keys() and not different, f"round {t}: {different[:3]}"
    for _, recorder in workers.values():  # no usage and no gate crosses the wire in the clear
        for url, body in recorder.bodies:
            said = _readable(url, body)
            assert b"head_usage" not in said and b"gate" not in said


def _readable(url: str, body: bytes) -> bytes:
    """What a request says in the clear: an upload's safetensors header, or the whole of any other body.

    An upload's tensors are masked: uniform bytes, which hold any given 4-byte word now and then.
    """
    if not url.endswith("/updates"):
        return body
    length = int.from_bytes(body[:8], "little")
    return body[8 : 8 + length]


def test_no_upload_on_the_wire_or_in_the_database_reveals_a_site(
    coordinator: TestClient,
    coordinator_settings,
    site_data: dict[str, SiteData],
    tmp_path: Path,  # noqa: ANN001
) -> None:
    config = secure_config(rounds=1)
    workers = agents(coordinator, site_data, tmp_path)
    study_id = run_study(coordinator, workers, config)
    study = StudyTerms.model_validate(config)
    layout = secure_layout(study.model, study.algorithm, train=True, fraction_bits=24, ring_bits=32)
    floating = {n for n, spec in shared_schema(study).items() if spec.dtype.is_floating_point}
    assert set(layout.narrow_names) == floating  # every floating model tensor sums as its change
    base, _ = initial_state(study)  # theta^g_0, which the changes are taken from
    outcome = next(iter(simulate_study(study, site_data, CPU)))  # the same training: theta_k of each site
    for name, (_, recorder) in workers.items():
        uploads = [body for url, body in recorder.bodies if url.endswith("/updates")]
        assert len(uploads) == 2  # the masked vectors of the training round and of the final evaluation
        for body in recorder.bodies:
            assert b"pos_hist" not in body[1] and b'"tp"' not in body[1]  # no statistics in the clear
        tensors, _ = load(uploads[0])
        assert set(tensors) == {MASKED_NARROW, MASKED_TENSOR}
        masked = layout.narrow_fixed_point.decode(tensors[MASKED_NARROW].numpy().view(np.uint32))
        weight = outcome.weights[name]
        result = outcome.results[name].shared
        change = np.concatenate([(result[n] - base[n]).double().reshape(-1).numpy() for n in layout.narrow_names])
        assert np.abs(change).max() > 0  # the site trained: there is something to hide
        correlation = np.corrcoef(masked, weight * change)[0, 1]
        assert abs(correlation) < 0.05, f"{name}'s masked upload correlates with its update: r = {correlation}"
        words = tensors[MASKED_NARROW].numpy().view(np.uint32)
        assert abs(float(words.mean()) / 2**32 - 0.5) < 0.01  # uniform in Z_2^32, as a mask makes it
    engine = create_engine(coordinator_settings.database_url)
    with Session(engine) as session:  # every stored update holds the masked vector alone
        digests = session.scalars(select(Update.sha256)).all()
        assert len(digests) == 4
        for digest in digests:
            blob = session.get(Blob, digest)
            assert blob is not None and blob.location in ("database", "store", "released")
    assert coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed"
