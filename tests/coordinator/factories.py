"""Builders for coordinator tests: enrolled sites, running studies, update bodies, evaluation statistics."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from fastapi.testclient import TestClient
from httpx import Response

from shared.evaluation.metrics import EvalStats, Summary, exact_summary
from shared.evaluation.summaries import site_summary
from shared.study.description import describe_study
from shared.tensors.codec import TensorDict, load
from shared.tensors.update_body import encode_update
from shared.wire.protocol import PROTOCOL_HEADER, PROTOCOL_VERSION, StudyOffer, UpdateMeta
from site_agent.approvals import study_key as store_key
from tests.conftest import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
OCTETS = {"Content-Type": "application/octet-stream"}


def bearer(token: str) -> dict[str, str]:
    """Authorization headers for `token`."""
    return {"Authorization": f"Bearer {token}"}


def enrol(client: TestClient, name: str) -> dict[str, str]:
    """Enrol a site; the headers of its agent: its token and the protocol version it speaks."""
    response = client.post("/api/v1/sites", json={"name": name}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return site_headers(response.json()["token"]["token"])


def site_headers(token: str) -> dict[str, str]:
    """What a site agent of this release sends with every request."""
    return {**bearer(token), PROTOCOL_HEADER: str(PROTOCOL_VERSION)}


def issue(client: TestClient, role: str) -> dict[str, str]:
    """A new admin/researcher/viewer token's headers."""
    response = client.post("/api/v1/tokens", json={"role": role, "label": f"a {role}"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return bearer(response.json()["token"])


def study_config(sites: list[str], **changes: Any) -> dict[str, Any]:
    """A tiny-model study config as JSON."""
    return {
        "model": {"preset": "tiny", "heads": "6:2"},
        "sites": sites,
        "rounds": 2,
        "round_deadline_s": 60.0,
        **changes,
    }


def create_study(client: TestClient, sites: list[str], **changes: Any) -> int:
    """A draft study's id."""
    response = client.post(
        "/api/v1/studies", json={"name": "trial", "config": study_config(sites, **changes)}, headers=ADMIN
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def offer(client: TestClient, headers: dict[str, str], study_id: int) -> StudyOffer:
    """The study as the coordinator offers it to the site of `headers`."""
    response = client.get("/api/v1/sites/me/studies", params={"finished": True}, headers=headers)
    assert response.status_code == 200, response.text
    offers = [StudyOffer.model_validate(item) for item in response.json()["data"]]
    return next(item for item in offers if item.study_id == study_id)


def approve(client: TestClient, headers: dict[str, str], study_id: int, state: str = "approved") -> str:
    """Report the site's approval of the study, as its agent would (the digest it computes); the digest."""
    offered = offer(client, headers, study_id)
    digest = describe_study(offered, offered.site).digest()
    response = client.put(
        f"/api/v1/sites/me/studies/{study_id}/approval", json={"state": state, "digest": digest}, headers=headers
    )
    assert response.status_code == 204, response.text
    return digest


def running_study(
    client: TestClient, sites: tuple[str, ...] = ("lyon", "oslo"), *, approved: bool = True, **changes: Any
) -> tuple[int, dict[str, dict[str, str]]]:
    """(study id, site name -> headers) of a started study over freshly enrolled sites (that approved it)."""
    headers = {name: enrol(client, name) for name in sites}
    study_id = create_study(client, list(sites), **changes)
    if approved:
        for site_headers_ in headers.values():
            approve(client, site_headers_, study_id)
    response = client.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN)
    assert response.status_code == 200, response.text
    return study_id, headers


def next_task(client: TestClient, headers: dict[str, str]) -> dict[str, Any]:
    """The site's current task (asserting there is one)."""
    response = client.get("/api/v1/tasks/next", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def download(client: TestClient, url: str, headers: dict[str, str]) -> TensorDict:
    """Tensors at `url`."""
    response = client.get(url, headers=headers)
    assert response.status_code == 200, response.text
    return load(response.content)[0]


def shifted(tensors: TensorDict, delta: float) -> TensorDict:
    """Floating tensors plus `delta`; integer tensors plus round(delta)."""
    return {name: t + delta if t.is_floating_point() else t + round(delta) for name, t in tensors.items()}


def update_body(tensors: TensorDict, num_examples: int, loss: float = 0.5, **metrics: Any) -> bytes:
    """An upload body: safetensors with the UpdateMeta in its header."""
    meta = UpdateMeta(num_examples=num_examples, metrics={"loss": loss, **metrics}, train_seconds=2.0)
    return encode_update(tensors, meta)


def upload(client: TestClient, task: dict[str, Any], headers: dict[str, str], body: bytes) -> Response:
    """POST `body` to the task's update URL."""
    return client.post(task["update_url"], content=body, headers={**headers, **OCTETS})


def train_and_upload(
    client: TestClient, headers: dict[str, str], delta: float, num_examples: int, **metrics: Any
) -> Response:
    """Poll, download theta^g_{t-1}, 'train' by shifting it by `delta`, and upload."""
    task = next_task(client, headers)
    base = download(client, task["global_model_url"], headers)
    return upload(client, task, headers, update_body(shifted(base, delta), num_examples, **metrics))


def evaluate_and_upload(
    client: TestClient, headers: dict[str, str], num_examples: int = 10, **metrics: Any
) -> Response:
    """Answer the final evaluation round: statistics only, no tensors."""
    task = next_task(client, headers)
    assert task["kind"] == "evaluate", task
    return upload(client, task, headers, update_body({}, num_examples, **metrics))


def _random_predictions(seed: int, n_samples: int, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = rng.random((n_samples, n_classes)) < 0.3
    return truth, np.clip(truth * 0.4 + rng.random((n_samples, n_classes)) * 0.6, 0, 1)


def eval_stats(seed: int, n_samples: int = 40, n_classes: int = 20) -> EvalStats:
    """Statistics of random labels and scores."""
    truth, scores = _random_predictions(seed, n_samples, n_classes)
    return EvalStats.from_predictions(truth, scores, loss_sum=float(n_samples) * 0.7)


def local_eval(seed: int, n_samples: int = 40, n_classes: int = 20, *, clinical: bool = False) -> Summary:
    """A site's exact scalar report of random labels and scores; `clinical`: with the clinical figures too.

    The clinical figures are those of a site at or above privacy.min_records: exact, each with its
    bootstrap interval drawn from `seed` (shared.evaluation.summaries.site_summary).
    """
    truth, scores = _random_predictions(seed, n_samples, n_classes)
    if clinical:
        return site_summary(truth, scores, float(n_samples) * 0.7, seed=seed)
    return exact_summary(truth, scores, loss_sum=float(n_samples) * 0.7)


def expected_average(updates: list[tuple[TensorDict, float]]) -> TensorDict:
    """Hand-rolled reference: floats as the float64 weighted mean, integers as the max."""
    total = sum(w for _, w in updates)
    names = updates[0][0].keys()
    out: TensorDict = {}
    for name in names:
        first = updates[0][0][name]
        if first.is_floating_point():
            out[name] = (sum(t[name].double() * w for t, w in updates) / total).to(first.dtype)
        else:
            out[name] = torch.stack([t[name] for t, _ in updates]).amax(dim=0)
    return out


def site_store_key(client: TestClient, study_id: int) -> str:
    """The key a site's store keeps the study's state under."""
    return store_key(study_id, client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["uid"])


def reported_study(client: TestClient, sites: tuple[str, ...] = ("lyon", "oslo")) -> int:
    """A two-round study driven to its end, every site reporting every figure: the clinical ones too.

    In each round (and the final evaluation) each site uploads its personalised model's exact report
    with bootstrap intervals (`local_eval(..., clinical=True)`) and the statistics of the global model
    it received (`eval_stats`), 40 test records each, so every summary of every round has its figures.
    """
    study_id, headers = running_study(client, sites)
    for number in (1, 2):
        for i, site in enumerate(headers.values()):
            seed = 10 * number + i
            figures = {"eval_stats": eval_stats(seed).to_dict(), "local_eval": local_eval(seed, clinical=True)}
            assert train_and_upload(client, site, 0.01 * (i + 1), 30 + 10 * i, **figures).status_code == 201
    for i, site in enumerate(headers.values()):
        figures = {"eval_stats": eval_stats(30 + i).to_dict(), "local_eval": local_eval(30 + i, clinical=True)}
        assert evaluate_and_upload(client, site, 30 + 10 * i, **figures).status_code == 201
    assert client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed"
    return study_id
