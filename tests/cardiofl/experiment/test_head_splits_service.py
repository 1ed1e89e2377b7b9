"""Per-site head splits end to end: the service equals the runner bit for bit, and no local head leaves a site."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx
import torch
from fastapi.testclient import TestClient

from cardiofl.experiment.readings import PHI_K_AVERAGED
from cardiofl.experiment.runner import load_sites, simulate_study
from cardiofl.experiment.site_rounds import RoundOutcome
from shared.algorithms.head_splits import unused_heads_leaked
from shared.tensors.codec import TensorDict, load
from shared.terms import StudyTerms
from site_agent.client import CoordinatorClient
from site_agent.data import SiteData
from site_agent.store import SiteStore, generate_key
from site_agent.worker import SiteWorker
from tests.cardiofl.experiment.test_runner import CPU, tiny_experiment
from tests.coordinator.factories import ADMIN, enrol


class Recording(httpx.BaseTransport):
    """The test client's transport, keeping every update body a site sends."""

    def __init__(self, inner: httpx.BaseTransport, bodies: list[bytes]) -> None:
        self.inner, self.bodies = inner, bodies

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("/updates"):
            self.bodies.append(request.read())
        return self.inner.handle_request(request)


def recording_worker(
    coordinator: TestClient, tmp_path: Path, name: str, site_data: SiteData, bodies: list[bytes]
) -> SiteWorker:
    """An enrolled site's agent on the test coordinator whose update bodies land in `bodies`."""
    transport = Recording(coordinator._transport, bodies)
    client = httpx.Client(transport=transport, base_url=str(coordinator.base_url), headers=enrol(coordinator, name))
    store = SiteStore(tmp_path / "stores" / name, generate_key(), name)
    return SiteWorker(
        site=name,
        client=CoordinatorClient(client, poll_wait_s=0.0),
        store=store,
        data=lambda: site_data,
        runtime=CPU,
        progress_bar=False,
        auto_approve=True,
    )


def service_equals_runner(
    coordinator: TestClient, tmp_path: Path, study: StudyTerms, data: Mapping[str, SiteData]
) -> tuple[dict, dict[int, TensorDict], list[RoundOutcome], dict[str, list[bytes]]]:
    """Run `study` through the coordinator and recording agents, and in the runner; assert theta^g_1, _2 equal.

    Returns the created study, the service's global models by round, the runner's outcomes and
    every site's upload bodies.
    """
    sent: dict[str, list[bytes]] = {name: [] for name in study.sites}
    workers = [recording_worker(coordinator, tmp_path, name, data[name], sent[name]) for name in study.sites]
    created = coordinator.post(
        "/api/v1/studies", json={"name": "service vs runner", "config": study.model_dump(mode="json")}, headers=ADMIN
    ).json()
    assert coordinator.post(f"/api/v1/studies/{created['id']}/start", headers=ADMIN).status_code == 200
    for _ in range(study.rounds + 1):
        for worker in workers:
            assert worker.poll_once()
    service = {
        t: load(coordinator.get(f"/api/v1/studies/{created['id']}/models/{t}", headers=ADMIN).content)[0]
        for t in (1, 2)
    }
    outcomes = list(simulate_study(study, data, CPU))
    for t in (1, 2):
        ours = outcomes[t - 1].global_model
        assert ours.keys() == service[t].keys()
        different = [n for n in ours if not torch.equal(ours[n], service[t][n])]
        assert not different, f"round {t}: {len(different)} tensors differ, e.g. {different[:3]}"
    return created, service, outcomes, sent


def test_per_site_splits_in_the_service_equal_the_runner(coordinator: TestClient, tmp_path: Path) -> None:
    experiment = tiny_experiment(tmp_path, seeds=[7], heads=["6:2"], privacy={"min_records": 3})
    data = load_sites(experiment)
    (key,) = experiment.runs()
    raw = experiment.study(key).model_dump(mode="json")
    raw["model"]["site_heads"] = {"site-2": "3:5"}
    study = StudyTerms.model_validate(raw)

    created, service, outcomes, sent = service_equals_runner(coordinator, tmp_path, study, data)
    assert PHI_K_AVERAGED in outcomes[-1].readings

    # on the wire: one schema for both sites, and site-2's local heads 3..7 only as zeros
    uploads = {site: [load(body)[0] for body in bodies if load(body)[0]] for site, bodies in sent.items()}
    assert len(uploads["site-2"]) == study.rounds
    schemas = {tuple((n, tuple(t.shape)) for n, t in sorted(u.items())) for us in uploads.values() for u in us}
    assert len(schemas) == 1
    config_2 = study.model.for_site("site-2").config()
    for tensors in uploads["site-2"]:
        assert unused_heads_leaked(tensors, config_2) == []
        w_out = tensors["blocks.0.global_branch.out_proj.weight"]
        assert w_out[:, 3 * config_2.head_dim :].abs().sum() == 0 and w_out[:, : 3 * config_2.head_dim].abs().sum() > 0
    # heads 6, 7 are global at no site: theta^g keeps them as they were in round 0
    head_dim = config_2.head_dim
    theta_0 = load(coordinator.get(f"/api/v1/studies/{created['id']}/models/0", headers=ADMIN).content)[0]
    name = "blocks.0.global_branch.out_proj.weight"
    assert torch.equal(service[2][name][:, 6 * head_dim :], theta_0[name][:, 6 * head_dim :])
    assert not torch.equal(service[2][name][:, : 6 * head_dim], theta_0[name][:, : 6 * head_dim])

    study_shown = coordinator.get(f"/api/v1/studies/{created['id']}", headers=ADMIN).json()
    assert study_shown["config"]["model"]["site_heads"] == {"site-2": "3:5"}
