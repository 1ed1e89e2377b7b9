"""The site agent against the real coordinator app (in-process, over its HTTP API)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

import site_agent.loop
from coordinator.main import create_app
from shared.errors import MetricsError
from shared.model.partition import model_partition
from shared.tensors.codec import load
from shared.terms import ModelSpec
from shared.wire.protocol import UPDATE_META_KEY, RoundKind
from site_agent import local_round as local_round_module
from site_agent import site_rounds as site_rounds_module
from site_agent import worker as worker_module
from site_agent.client import CoordinatorClient
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.device import resolve_runtime
from site_agent.errors import TokenRefused
from site_agent.loop import run
from site_agent.store import SiteStore, StoreError, generate_key
from site_agent.worker import SiteWorker
from tests.conftest import coordinator_settings_for, create_tables
from tests.coordinator.factories import ADMIN, create_study, enrol, site_store_key

SITES = ("lyon", "oslo")
MODEL = ModelSpec(preset="tiny", heads="6:2")


@pytest.fixture(scope="module")
def site_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteData]:
    root = tmp_path_factory.mktemp("ecg")
    folders = generate_sites(root / "raw", n_sites=len(SITES), records_per_site=40, seed=3)
    return {
        name: open_site_data(ChallengeSource(path=folder, name=name), root / "cache" / name)
        for name, folder in zip(SITES, folders, strict=True)
    }


@dataclass
class Recorder:
    """Every request body an agent sends, by URL."""

    bodies: list[tuple[str, bytes]] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append((str(request.url), request.read()))


@dataclass
class Site:
    name: str
    headers: dict[str, str]
    key: bytes
    store_dir: Path
    worker: SiteWorker
    recorder: Recorder


def make_worker(
    coordinator: TestClient, name: str, headers: dict[str, str], store_dir: Path, key: bytes, data: SiteData
) -> tuple[SiteWorker, Recorder]:
    recorder = Recorder()
    http = httpx.Client(
        transport=coordinator._transport,
        base_url=str(coordinator.base_url),
        headers=headers,
        event_hooks={"request": [recorder]},
    )
    worker = SiteWorker(
        site=name,
        client=CoordinatorClient(http, poll_wait_s=0.0),
        store=SiteStore(store_dir, key, name),
        data=lambda: data,
        runtime=resolve_runtime("cpu"),
        progress_bar=False,
        auto_approve=True,
    )
    return worker, recorder


@pytest.fixture()
def sites(coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path) -> dict[str, Site]:
    out = {}
    for name in SITES:
        headers = enrol(coordinator, name)
        key = generate_key()
        worker, recorder = make_worker(coordinator, name, headers, tmp_path / name, key, site_data[name])
        out[name] = Site(name, headers, key, tmp_path / name, worker, recorder)
    return out


def start_study(coordinator: TestClient, rounds: int = 3, **changes: object) -> int:
    study_id = create_study(
        coordinator,
        list(SITES),
        rounds=rounds,
        training={"lr": 0.05, "batch_size": 8, "max_steps": 2},
        seed=11,
        **changes,
    )
    response = coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN)
    assert response.status_code == 200, response.text
    return study_id


def study(coordinator: TestClient, study_id: int) -> dict:
    return coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()


def rounds(coordinator: TestClient, study_id: int) -> list[dict]:
    return coordinator.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]


def run_rounds(sites: dict[str, Site], n: int) -> None:
    for _ in range(n):
        for site in sites.values():
            assert site.worker.poll_once()


@pytest.fixture()
def counted_training(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    calls: list[str] = []
    original = local_round_module.run_local_round

    def counting(spec, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(f"{spec.site}:{spec.round}")
        return original(spec, *args, **kwargs)

    monkeypatch.setattr("site_agent.site_rounds.run_local_round", counting)
    yield calls


def test_agents_complete_a_study_and_only_shared_tensors_cross_the_wire(
    coordinator: TestClient, sites: dict[str, Site], site_data: dict[str, SiteData]
) -> None:
    study_id = start_study(coordinator, rounds=3)
    run_rounds(sites, 3)
    assert study(coordinator, study_id)["status"] == "running"  # the final evaluation round is open
    run_rounds(sites, 1)
    assert study(coordinator, study_id)["status"] == "completed"
    completed = rounds(coordinator, study_id)
    assert [(r["kind"], r["status"]) for r in completed] == [("train", "completed")] * 3 + [("evaluate", "completed")]
    training = completed[:3]
    n_test = {name: len(data.test) for name, data in site_data.items()}
    assert all(0 < n < 20 for n in n_test.values())  # below the study's default privacy.min_records
    for r in training:  # theta^g_t, evaluated in round t+1: no site has enough test records to pool
        assert r["pooled"]["eval"] == {
            "loss": None,
            "micro_f1": None,
            "map": None,
            "map_present": None,
            "n_samples": 0,
            "n_sites": 0,
            "n_sites_too_few": 2,
        }
    for r in completed:  # the personalised models' exact scalars are not subject to the minimum
        assert r["pooled"]["local_eval"]["n_samples"] == sum(n_test.values())
        assert {u["site"]: u["local_eval"]["n_samples"] for u in r["updates"]} == n_test

    partition = model_partition(MODEL.config())
    private = set(partition.local)
    raw_signals = [
        np.ascontiguousarray(data.train.signals[i, 0, 100:116]).tobytes()
        for data in site_data.values()
        for i in range(5)
    ]
    uploads = 0
    for site in sites.values():
        assert site.recorder.bodies, "the agent sent requests"
        for url, body in site.recorder.bodies:
            for name in private:
                assert name.encode() not in body, f"{name} crossed the wire to {url}"
            for chunk in raw_signals:
                assert chunk not in body, f"raw signal bytes crossed the wire to {url}"
            if not url.endswith("/updates"):  # other requests (approvals) carry no update
                continue
            uploads += 1
            tensors, metadata = load(body)
            evaluation_only = not tensors
            assert evaluation_only or set(tensors) == set(partition.shared)
            metrics = json.loads(metadata[UPDATE_META_KEY])["metrics"]
            # too few test records: the marker alone, no counts or histograms of them
            assert metrics["eval_stats"] == {"too_few_records": True}
            local_eval = metrics["local_eval"]  # the personalised model: scalars only
            assert set(local_eval) == {"n_samples", "loss", "micro_f1", "map", "map_present"}
            assert local_eval["n_samples"] == n_test[site.name]
            assert all(value is None or np.ndim(value) == 0 for value in metrics.values() if value is not local_eval)
            assert all(np.ndim(value) == 0 for value in local_eval.values() if value is not None)
            for key in ("tp", "fp", "fn", "pos_hist", "neg_hist", "n_bins"):
                assert f'"{key}"'.encode() not in body
    assert uploads == 8  # 3 training rounds and the final evaluation, for 2 sites


def test_phi_persists_differs_between_sites_and_is_encrypted(coordinator: TestClient, sites: dict[str, Site]) -> None:
    start_study(coordinator, rounds=2)
    run_rounds(sites, 1)
    lyon, oslo = sites["lyon"], sites["oslo"]
    (study_name,) = {p.name for p in (lyon.store_dir / "studies").iterdir()}
    r1_lyon = lyon.worker.store.load_local(study_name)
    r1_oslo = oslo.worker.store.load_local(study_name)
    assert r1_lyon[0] == r1_oslo[0] == 1
    assert any(not torch.equal(r1_lyon[1][n], r1_oslo[1][n]) for n in r1_lyon[1])  # trained on different data
    run_rounds(sites, 1)
    r2_lyon = lyon.worker.store.load_local(study_name)
    assert r2_lyon[0] == 2 and lyon.worker.store.local_rounds(study_name) == [1, 2]
    assert any(not torch.equal(r1_lyon[1][n], r2_lyon[1][n]) for n in r1_lyon[1])  # it kept training
    # at rest the tensors are unreadable without the key
    with pytest.raises(StoreError):
        SiteStore(lyon.store_dir, generate_key(), "lyon")
    raw = (lyon.store_dir / "studies" / study_name / "local-r000002.enc").read_bytes()
    assert b"local_branch" not in raw


def _uploaded_tensors(site: Site) -> list[dict[str, torch.Tensor]]:
    return [load(body)[0] for url, body in site.recorder.bodies if url.endswith("/updates") and body]


def _run_on_a_new_database(
    tmp_path: Path, db_name: str, stores: dict[str, tuple[Path, bytes]], site_data: dict[str, SiteData]
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """A fresh coordinator database whose study 1 runs 2 rounds with the given site stores."""
    url = f"sqlite:///{tmp_path / db_name}"
    create_tables(url)
    with TestClient(create_app(coordinator_settings_for(url))) as coordinator:
        sites = {}
        for name, (store_dir, key) in stores.items():
            headers = enrol(coordinator, name)
            worker, recorder = make_worker(coordinator, name, headers, store_dir, key, site_data[name])
            sites[name] = Site(name, headers, key, store_dir, worker, recorder)
        assert start_study(coordinator, rounds=2) == 1
        run_rounds(sites, 2)
    return {name: _uploaded_tensors(site) for name, site in sites.items()}


def test_a_store_left_by_another_databases_study_changes_nothing(
    coordinator: TestClient, sites: dict[str, Site], site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    """Study 1 of a new database, same seed: the same uploads whether the sites' stores are new or used."""
    assert start_study(coordinator, rounds=3) == 1
    run_rounds(sites, 4)  # three rounds and the final evaluation: phi_k of rounds 1-3 (and more) kept
    used = {name: (site.store_dir, site.key) for name, site in sites.items()}
    fresh = {name: (tmp_path / f"fresh-{name}", generate_key()) for name in sites}
    with_used_stores = _run_on_a_new_database(tmp_path, "again.db", used, site_data)
    with_fresh_stores = _run_on_a_new_database(tmp_path, "fresh.db", fresh, site_data)
    for name in sites:
        assert len(with_used_stores[name]) == len(with_fresh_stores[name]) == 2
        for used_upload, fresh_upload in zip(with_used_stores[name], with_fresh_stores[name], strict=True):
            assert used_upload.keys() == fresh_upload.keys()
            assert all(torch.equal(used_upload[k], fresh_upload[k]) for k in used_upload)


def test_crash_between_training_and_upload_resumes_without_retraining(
    coordinator: TestClient, sites: dict[str, Site], site_data: dict[str, SiteData], counted_training: list[str]
) -> None:
    study_id = start_study(coordinator, rounds=1)
    lyon = sites["lyon"]

    def crash(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt("killed before the upload left")

    original_upload = lyon.worker.client.upload
    lyon.worker.client.upload = crash  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        lyon.worker.poll_once()
    lyon.worker.client.upload = original_upload  # type: ignore[method-assign]
    assert counted_training == ["lyon:1"]
    assert rounds(coordinator, study_id)[0]["updates"] == []

    # a fresh process on the same store: re-sends the pending upload instead of training again
    restarted, _ = make_worker(coordinator, "lyon", lyon.headers, lyon.store_dir, lyon.key, site_data["lyon"])
    run(restarted, threading.Event(), poll_interval_s=0.01, max_rounds=0)
    assert counted_training == ["lyon:1"]
    (update,) = rounds(coordinator, study_id)[0]["updates"]
    assert update["site"] == "lyon"
    assert restarted.store.load_pending(site_store_key(coordinator, study_id)) is None
    assert restarted.store.local_rounds(site_store_key(coordinator, study_id)) == [1]


def test_crash_between_upload_and_commit_does_not_double_count(
    coordinator: TestClient, sites: dict[str, Site], site_data: dict[str, SiteData], counted_training: list[str]
) -> None:
    study_id = start_study(coordinator, rounds=2)
    lyon, oslo = sites["lyon"], sites["oslo"]

    def crash(_study: str) -> int:
        raise KeyboardInterrupt("killed after the upload, before the commit")

    lyon.worker.store.commit_pending = crash  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        lyon.worker.poll_once()
    assert len(rounds(coordinator, study_id)[0]["updates"]) == 1
    assert oslo.worker.poll_once()  # round 1 completes with both updates
    assert rounds(coordinator, study_id)[0]["status"] == "completed"

    restarted, _ = make_worker(coordinator, "lyon", lyon.headers, lyon.store_dir, lyon.key, site_data["lyon"])
    assert (
        restarted.store.local_rounds(site_store_key(coordinator, study_id)) == []
    )  # phi_k of round 1 was not committed yet
    assert restarted.poll_once()  # settles the pending round-1 upload first
    assert restarted.store.local_rounds(site_store_key(coordinator, study_id)) == [1]
    assert restarted.poll_once()  # then trains round 2, the task its next poll is given
    assert restarted.store.local_rounds(site_store_key(coordinator, study_id)) == [1, 2]
    assert counted_training == ["lyon:1", "oslo:1", "lyon:2"]
    first = rounds(coordinator, study_id)[0]
    assert sorted(u["site"] for u in first["updates"]) == ["lyon", "oslo"]  # no double count


class FlakyTransport(httpx.BaseTransport):
    """Refuses the first `failures` requests with a connection error, then passes them on."""

    def __init__(self, inner: httpx.BaseTransport, failures: int) -> None:
        self.inner, self.failures, self.refused = inner, failures, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.refused < self.failures:
            self.refused += 1
            raise httpx.ConnectError("connection refused", request=request)
        return self.inner.handle_request(request)


def test_agent_waits_while_the_coordinator_is_down_then_continues(
    coordinator: TestClient, sites: dict[str, Site], caplog: pytest.LogCaptureFixture
) -> None:
    study_id = start_study(coordinator, rounds=1)
    lyon = sites["lyon"]
    flaky = FlakyTransport(coordinator._transport, failures=4)
    lyon.worker.client.http._transport = flaky
    with caplog.at_level(logging.WARNING, logger="site_agent.loop"):
        run(lyon.worker, threading.Event(), poll_interval_s=0.01, max_backoff_s=0.05, max_rounds=1)
    assert flaky.refused == 4
    assert caplog.text.count("coordinator unreachable") == 4
    assert [u["site"] for u in rounds(coordinator, study_id)[0]["updates"]] == ["lyon"]


def test_a_revoked_token_stops_the_agent_with_its_reason(coordinator: TestClient, sites: dict[str, Site]) -> None:
    start_study(coordinator, rounds=1)
    lyon = sites["lyon"]
    tokens = coordinator.get("/api/v1/tokens", headers=ADMIN).json()["data"]
    (token_id,) = [t["id"] for t in tokens if t.get("site") == "lyon"]
    assert coordinator.delete(f"/api/v1/tokens/{token_id}", headers=ADMIN).status_code == 204
    asks = 0
    original = lyon.worker.client.own_site

    def counted_ask() -> str:  # a revoked token is refused from the first request on
        nonlocal asks
        asks += 1
        return original()

    lyon.worker.client.own_site = counted_ask  # type: ignore[method-assign]
    with pytest.raises(TokenRefused, match=r"refused this site's token \(revoked or unknown\)") as refused:
        run(lyon.worker, threading.Event(), poll_interval_s=0.01, max_backoff_s=0.02)
    assert asks == 1  # no retry can make it good: the agent stops (exit 2 in `cardiofl site run`)
    assert "ask its operator for a new one" in str(refused.value) and "\n" not in str(refused.value)


def test_cancelled_study_discards_the_pending_upload(
    coordinator: TestClient, sites: dict[str, Site], caplog: pytest.LogCaptureFixture
) -> None:
    study_id = start_study(coordinator, rounds=1)
    lyon = sites["lyon"]

    def cancel_then_upload(url: str, body: bytes, **options: bool):  # noqa: ANN202
        assert coordinator.post(f"/api/v1/studies/{study_id}/cancel", headers=ADMIN).status_code == 200
        return original(url, body, **options)

    original = lyon.worker.client.upload
    lyon.worker.client.upload = cancel_then_upload  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="site_agent.worker"):
        lyon.worker.poll_once()
    assert "refused" in caplog.text
    assert lyon.worker.store.load_pending(site_store_key(coordinator, study_id)) is None
    assert (
        lyon.worker.store.local_rounds(site_store_key(coordinator, study_id)) == []
    )  # phi_k of a refused round is never applied
    assert lyon.worker.poll_once() is False  # nothing more to do, no crash


def test_an_idle_agent_says_once_that_it_is_waiting_and_hands_its_free_memory_back_once(
    coordinator: TestClient, sites: dict[str, Site], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_back: list[bool] = []
    monkeypatch.setattr(site_agent.loop, "hand_back_idle_memory", lambda: handed_back.append(True) or True)
    lyon = sites["lyon"]  # enrolled, but no study is open
    lyon.worker.client.poll_wait_s = 0.0
    stop = threading.Event()
    polls = 0
    original = lyon.worker.poll_once

    def counted_poll() -> bool:
        nonlocal polls
        polls += 1
        if polls == 5:
            stop.set()
        return original()

    lyon.worker.poll_once = counted_poll  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="site_agent.loop"):
        run(lyon.worker, stop, poll_interval_s=0.01)
    assert polls == 5
    assert caplog.text.count("waiting: no task for site lyon") == 1
    assert handed_back == [True]  # at the first poll without a task, not at each


def test_an_agent_with_another_sites_token_stops_and_says_which_setting(
    coordinator: TestClient, sites: dict[str, Site]
) -> None:
    from site_agent.errors import WrongSite

    lyon = sites["lyon"]
    lyon.worker.site = "oslo"  # configured as oslo, holding lyon's token
    with pytest.raises(WrongSite, match="setting 'name'.*'oslo'.*belongs to site 'lyon'"):
        run(lyon.worker, threading.Event(), poll_interval_s=0.01)


def test_a_model_that_gives_no_valid_scores_is_declined_with_the_reason_and_the_agent_goes_on(
    coordinator: TestClient, sites: dict[str, Site], monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id = start_study(coordinator, rounds=1)

    def broken(*_args: object, **_kwargs: object) -> None:
        raise MetricsError("y_score must be finite probabilities in [0, 1] (apply the sigmoid to logits first)")

    monkeypatch.setattr(site_rounds_module, "run_local_round", broken)
    lyon = sites["lyon"].worker
    assert lyon.poll_once()  # takes the task, fails to compute it, declines: the agent does not stop
    audit = coordinator.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    (declined,) = [event for event in audit if event["action"] == "task.declined"]
    assert "the model gave no valid scores: y_score must be finite" in declined["detail"]["reason"]
    assert not lyon.poll_once()  # not offered the declined round again, and still polling


def test_a_negative_running_variance_is_read_as_zero_and_the_model_stays_finite() -> None:
    from shared.model.network import build_model, load_released, preset

    released = {name: tensor.clone() for name, tensor in build_model(preset("tiny"), seed=1).state_dict().items()}
    name = next(n for n in released if n.endswith("running_var"))
    released[name].fill_(-0.5)  # what DP noise on a released model can do
    batch = torch.randn(2, 12, 1000)
    plain = build_model(preset("tiny"), seed=2).eval()
    plain.load_state_dict(released)
    loaded = load_released(build_model(preset("tiny"), seed=2), released).eval()
    with torch.no_grad():
        assert not torch.isfinite(plain(batch)).all()  # as it was loaded before
        assert torch.isfinite(loaded(batch)).all()
    assert float(loaded.state_dict()[name].min()) == 0.0 and float(released[name].max()) == -0.5  # input untouched


def test_each_task_runs_the_workflow_of_its_kind_and_uploads_the_bytes_it_holds(
    coordinator: TestClient, sites: dict[str, Site], monkeypatch: pytest.MonkeyPatch
) -> None:
    start_study(coordinator, rounds=1)
    site = next(iter(sites.values()))
    events: list[str] = []
    store, client = site.worker.store, site.worker.client
    for target, name in ((store, "load_pending"), (store, "save_pending"), (client, "upload")):
        original = getattr(target, name)

        def spy(*args, _original=original, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            events.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(target, name, spy)
    chosen: list[str] = []
    real_choice = worker_module.site_round_for
    monkeypatch.setattr(worker_module, "site_round_for", lambda task: chosen.append(task.kind) or real_choice(task))
    assert site.worker.poll_once()  # round 1: training
    # the pending upload is looked for once before training; once written, the bytes held are sent (the
    # store's commit reads phi_k back only after the coordinator accepted them)
    assert events[: events.index("upload") + 1] == ["load_pending", "save_pending", "upload"]
    for other in list(sites.values())[1:]:
        assert other.worker.poll_once()
    assert site.worker.poll_once()  # round 2: the final evaluation
    # one choice per task handled, by every site's worker: round 1 trains, round 2 evaluates
    assert chosen == [RoundKind.TRAIN] * len(sites) + [RoundKind.EVALUATE]
