"""Every algorithm through the real coordinator app and site agents: names on the wire, rounds, the server step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from shared.algorithms.exchange import DITTO_PERSONAL, SCAFFOLD_C, SCAFFOLD_DELTA_C
from shared.algorithms.registry import ALGORITHMS
from shared.study.rules import global_schema, shared_schema, study_exchange
from shared.tensors.codec import dump, load
from shared.terms import StudyTerms
from shared.wire.protocol import UPDATE_META_KEY
from site_agent.data.loader import SiteData
from site_agent.store import generate_key
from site_agent.worker import SiteWorker
from tests.coordinator.factories import ADMIN, create_study, download, enrol, site_store_key
from tests.site_agent.algorithms.conftest import make_site
from tests.site_agent.test_agent import Recorder, make_worker

SITES = ("lyon", "oslo")


@pytest.fixture(scope="module")
def data() -> dict[str, SiteData]:
    return {"lyon": make_site(11, n_train=16, n_test=4), "oslo": make_site(12, n_train=24, n_test=4)}


def start(coordinator: TestClient, tmp_path: Path, data: dict[str, SiteData], **config: object) -> tuple[int, dict]:
    agents: dict[str, tuple[SiteWorker, Recorder]] = {}
    for name in SITES:
        agents[name] = make_worker(
            coordinator, name, enrol(coordinator, name), tmp_path / name, generate_key(), data[name]
        )
    study_id = create_study(
        coordinator, list(SITES), rounds=2, training={"lr": 0.05, "batch_size": 8, "max_steps": 2}, seed=7, **config
    )
    assert coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    return study_id, agents


def run_until_done(coordinator: TestClient, study_id: int, agents: dict) -> list[dict]:
    for _ in range(10):
        for worker, _ in agents.values():
            worker.poll_once()
        study = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
        if study["status"] == "completed":
            return coordinator.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    raise AssertionError(f"study {study_id} did not complete: {study['status']}")


def uploads(recorder: Recorder) -> list[tuple[dict, dict]]:
    """(tensors, update meta) of every upload body the agent sent."""
    sent = []
    for url, body in recorder.bodies:
        if url.endswith("/updates"):
            tensors, metadata = load(body)
            sent.append((tensors, json.loads(metadata[UPDATE_META_KEY])))
    return sent


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_uploads_are_exactly_the_declared_shared_schema(
    algorithm: str, coordinator: TestClient, tmp_path: Path, data: dict[str, SiteData]
) -> None:
    study_id, agents = start(coordinator, tmp_path, data, algorithm={"name": algorithm})
    config = StudyTerms.model_validate(coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["config"])
    exchange = study_exchange(config)
    rounds = run_until_done(coordinator, study_id, agents)
    assert [(r["kind"], r["status"]) for r in rounds] == [("train", "completed")] * 2 + [("evaluate", "completed")]
    assert all(u["weight"] is not None for r in rounds[:2] for u in r["updates"])
    assert all(r["pooled"]["global_label"] == exchange.global_label() for r in rounds)  # what Global is

    upload_names, local_names = set(shared_schema(config)), exchange.local_names()
    for worker, recorder in agents.values():
        sent = uploads(recorder)
        assert len(sent) == 3  # two training rounds and the final evaluation
        for tensors, _ in sent[:2]:
            assert set(tensors) == upload_names and not set(tensors) & local_names
            for tensor_name, tensor in tensors.items():
                spec = shared_schema(config)[tensor_name]
                assert tuple(tensor.shape) == spec.shape and tensor.dtype == spec.dtype
        assert sent[2][0] == {}  # the final evaluation sends statistics only
        kept_round, kept = worker.store.load_local(site_store_key(coordinator, study_id))
        assert kept_round == 3 and set(exchange.partition.local) <= set(kept) <= local_names  # 3: the evaluation
    for number in (0, 1, 2):
        theta = download(coordinator, f"/api/v1/studies/{study_id}/models/{number}", ADMIN)
        assert set(theta) == set(global_schema(config.model, config.algorithm))


def test_scaffold_server_step_through_the_service(
    coordinator: TestClient, tmp_path: Path, data: dict[str, SiteData]
) -> None:
    study_id, agents = start(coordinator, tmp_path, data, algorithm={"name": "scaffold", "params": {"server_lr": 1.0}})
    run_until_done(coordinator, study_id, agents)
    first = {name: uploads(recorder)[0] for name, (_, recorder) in agents.items()}
    n = {name: meta["num_examples"] for name, (_, meta) in first.items()}  # 16 and 24: weights 0.4, 0.6
    theta_1 = download(coordinator, f"/api/v1/studies/{study_id}/models/1", ADMIN)
    for name, value in theta_1.items():
        if name.startswith(SCAFFOLD_C):  # c_0 = 0: c_1 = Σ delta c_k / N
            delta = SCAFFOLD_DELTA_C + name.removeprefix(SCAFFOLD_C)
            expected = sum(first[site][0][delta] for site in SITES) / 2
            torch.testing.assert_close(value, expected)
        elif value.is_floating_point():  # server_lr 1: the sample-weighted average of the y_k
            expected = sum(first[site][0][name] * n[site] for site in SITES) / sum(n.values())
            torch.testing.assert_close(value, expected)
    assert any(bool(value.abs().sum() > 0) for name, value in theta_1.items() if name.startswith(SCAFFOLD_C))


def test_uncertainty_weights_and_centre_dropout_through_the_service(
    coordinator: TestClient, tmp_path: Path, data: dict[str, SiteData]
) -> None:
    study_id, agents = start(
        coordinator,
        tmp_path,
        data,
        aggregation={"name": "uncertainty", "params": {"epsilon": 0.01, "mc_passes": 2}},
        participation={"name": "fewer_on_odd", "params": {"f": 0.5}},
    )
    rounds = run_until_done(coordinator, study_id, agents)
    odd, even = rounds[0], rounds[1]
    assert len(odd["participants"]) == 1 and list(odd["participants"].values()) == [
        2.0
    ]  # half the sites, twice the steps
    assert even["participants"] == {"lyon": 1.0, "oslo": 1.0}
    (single,) = odd["updates"]
    assert single["weight"] == pytest.approx(1.0)
    entropies = {}
    for name, (_, recorder) in agents.items():
        for _, meta in uploads(recorder):
            if "entropy" in meta["metrics"]:
                entropies.setdefault(name, []).append(meta["metrics"]["entropy"])
    raw = {u["site"]: u["num_examples"] / (entropies[u["site"]][-1] + 0.01) for u in even["updates"]}
    for update in even["updates"]:
        assert update["weight"] == pytest.approx(raw[update["site"]] / math.fsum(raw.values()))


def test_an_algorithm_s_private_state_is_refused_as_a_privacy_violation(
    coordinator: TestClient, tmp_path: Path, data: dict[str, SiteData]
) -> None:
    study_id, agents = start(coordinator, tmp_path, data, algorithm={"name": "ditto"})
    lyon, _ = agents["lyon"]
    original = lyon.client.upload

    def leaking(url: str, body: bytes, **options: bool):  # noqa: ANN202
        tensors, metadata = load(body)
        personal = {DITTO_PERSONAL + "head.bias": tensors["head.bias"]}
        return original(url, dump({**tensors, **personal}, metadata), **options)

    lyon.client.upload = leaking  # type: ignore[method-assign]
    lyon.poll_once()
    events = coordinator.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    (violation,) = [e for e in events if e["action"] == "privacy.violation"]
    assert violation["detail"]["code"] == "private_tensors_in_payload"
    assert (
        lyon.store.local_rounds(site_store_key(coordinator, study_id)) == []
    )  # the refused round changed nothing kept
