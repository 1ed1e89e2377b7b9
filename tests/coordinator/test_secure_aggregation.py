"""Secure rounds in the coordinator: dropout, failure below threshold, restarts, hostile messages, study rules.

Tests taking `client` or `settings` run on SQLite and on PostgreSQL (tests/coordinator/conftest.py).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

from coordinator.config import CoordinatorSettings
from coordinator.db import utc_now
from coordinator.main import create_app
from coordinator.rounds.closing import tick
from coordinator.storage.blobs import blob_store_of, open_blobs
from shared.algorithms.exchange import SCAFFOLD_C
from shared.algorithms.server import next_global
from shared.algorithms.weightings import aggregation_weights
from shared.privacy.discrete import DiscreteGaussian
from shared.study import dp as study_dp
from shared.study.checks import checked_terms
from shared.study.dp import norm_bound
from shared.study.rules import server_aggregator
from shared.study.secure_setup import round_quorum
from shared.tensors.codec import load
from shared.tensors.update_body import encode_update
from shared.terms import StudyTerms, TermsError
from shared.wire.protocol import UpdateMeta, UpdateMetrics
from shared.wire.secure import MASKED_NARROW, MASKED_TENSOR
from site_agent.client import CoordinatorClient
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.worker import SiteWorker
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, create_study, enrol
from tests.site_agent.test_agent import make_worker

SITES = ("a", "b", "c", "d")
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def four_sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteData]:
    """Four small synthetic sites: enough for one to drop and the rest to reach the threshold."""
    root = tmp_path_factory.mktemp("ecg4")
    sources = [ChallengeSource(path=f, name=n) for n, f in zip(SITES, generate_sites(root, 4, 24, 9), strict=True)]
    return {source.name: open_site_data(source, root / "cache" / source.name) for source in sources}


def privacy(colluding: int = 0, **changes: object) -> dict:
    """Against no colluding site by default: four sites then tolerate one dropout (t = 2, q = 3, 3 survivors).

    Against the terms' default c = (4 - 1) // 3 = 1 a round of four needs all four (t = q = 3): see
    graph.adversary_parameters.
    """
    secure = {"phase_timeout_s": TIMEOUT_S, "colluding": colluding}
    return {"min_records": 1, "secure_aggregation": secure, **changes}


def study_values(**changes: object) -> dict:
    return {
        "model": {"preset": "tiny", "heads": "6:2"},
        "training": {"optimizer": "sgd", "lr": 0.05, "batch_size": 8, "max_steps": 1},
        "rounds": 1,
        "seed": 2,
        "min_sites": 3,  # a round of four releases a sum of at least 3 inputs (t + 1 = q = 3 against c = 0)
        "privacy": privacy(),
        **changes,
    }


def start(
    coordinator: TestClient,
    data: dict[str, SiteData],
    tmp_path: Path,
    sites: tuple[str, ...] = SITES,
    **changes: object,
):  # noqa: ANN201
    workers = {
        name: make_worker(coordinator, name, enrol(coordinator, name), tmp_path / name, b"k" * 32, data[name])[0]
        for name in sites
    }
    for worker in workers.values():  # each agent registers its signing key at its first start
        worker.register_identity()
    study_id = create_study(coordinator, list(sites), **study_values(**{"min_sites": min(3, len(sites)), **changes}))
    assert coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    return study_id, workers


def cycle(workers: dict[str, SiteWorker], only: set[str] | None = None) -> None:
    for name, worker in workers.items():
        if only is None or name in only:
            worker.poll_once()


def past_phase_deadline(coordinator: TestClient) -> None:
    state = coordinator.app.state.coordinator
    tick(state.sessions, now=utc_now() + timedelta(seconds=TIMEOUT_S + 1), lease_s=300)


def rounds(coordinator: TestClient, study_id: int) -> list[dict]:
    return coordinator.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]


def model(coordinator: TestClient, study_id: int, number: int) -> dict[str, torch.Tensor]:
    return load(coordinator.get(f"/api/v1/studies/{study_id}/models/{number}", headers=ADMIN).content)[0]


@pytest.mark.parametrize("dropped_after", [None, "advertising", "sharing"])
def test_the_unmasked_average_is_the_survivors_weighted_average_within_the_bound(
    client: TestClient, four_sites: dict[str, SiteData], tmp_path: Path, dropped_after: str | None
) -> None:
    study_id, workers = start(client, four_sites, tmp_path)
    cycle(workers)  # train and advertise: phase 0 closes with all four
    trained = {name: w.secure.result for name, w in workers.items() if w.secure is not None}
    assert trained.keys() == set(SITES)
    active = set(SITES) - ({"c"} if dropped_after == "advertising" else set())
    cycle(workers, active)  # share
    if dropped_after == "advertising":
        past_phase_deadline(client)
    active -= {"c"} if dropped_after == "sharing" else set()
    cycle(workers, active)  # mask and upload
    if dropped_after == "sharing":
        past_phase_deadline(client)
    cycle(workers, active)  # sign the survivor set
    cycle(workers, active)  # reveal: the round is unmasked and aggregated
    shown = rounds(client, study_id)[0]
    assert shown["status"] == "completed", shown["note"]

    names = sorted(trained)  # the weights are fixed over the advertisers, then renormalised over the survivors
    weights = dict(zip(names, aggregation_weights([trained[n].meta.num_examples for n in names]), strict=True))
    survivors = sorted(active)
    total = sum(weights[n] for n in survivors)
    assert {u["site"]: u["weight"] for u in shown["updates"]} == pytest.approx(
        {n: weights[n] / total for n in survivors}
    )
    bound = len(survivors) * 2.0**-25 / total
    theta = model(client, study_id, 1)
    for name, tensor in theta.items():
        expected = sum(weights[n] * trained[n].shared[name].double() for n in survivors) / total
        if tensor.is_floating_point():
            assert torch.allclose(tensor.double(), expected, rtol=1e-6, atol=bound + 1e-7), name
        else:  # integer buffers: the weighted mean, rounded half to even
            assert torch.equal(tensor, torch.round(expected).to(tensor.dtype)), name


def test_below_threshold_the_round_fails_cleanly_and_is_retried(
    client: TestClient, four_sites: dict[str, SiteData], tmp_path: Path
) -> None:
    study_id, workers = start(client, four_sites, tmp_path)
    cycle(workers)  # all advertise
    cycle(workers, {"a"})  # only one site shares: below the quorum of two
    past_phase_deadline(client)
    first = rounds(client, study_id)
    assert [(r["attempt"], r["status"]) for r in first] == [(1, "failed"), (2, "open")]
    assert "secure aggregation, phase share: 1 of 4 sites, 3 needed" in first[0]["note"]
    for _ in range(7):  # every agent sees the failure, then takes the new attempt from its start
        cycle(workers)
    again = rounds(client, study_id)
    assert [(r["attempt"], r["status"]) for r in again[:2]] == [(1, "failed"), (2, "completed")]


def test_a_restarted_coordinator_resumes_mid_phase(
    settings: CoordinatorSettings, four_sites: dict[str, SiteData], tmp_path: Path
) -> None:
    with TestClient(create_app(settings)) as first:
        study_id, workers = start(first, four_sites, tmp_path, sites=("a", "b"))
        cycle(workers)  # advertise
        cycle(workers)  # share: phase 2 is open when the coordinator stops
    with TestClient(create_app(settings)) as second:
        for worker in workers.values():  # the same agents, their secure rounds in memory, now talk to the new one
            http = httpx.Client(
                transport=second._transport, base_url=str(second.base_url), headers=worker.client.http.headers
            )
            worker.client = CoordinatorClient(http, poll_wait_s=0.0)
        cycle(workers)  # mask
        cycle(workers)  # sign the survivor set
        cycle(workers)  # reveal
        assert rounds(second, study_id)[0]["status"] == "completed"
        assert set(model(second, study_id, 1))


def _site_post(coordinator: TestClient, headers: dict[str, str], url: str, body: dict) -> httpx.Response:
    return coordinator.post(url, json=body, headers=headers)


def test_hostile_or_malformed_messages_are_refused_with_reasons(
    coordinator: TestClient, four_sites: dict[str, SiteData], tmp_path: Path
) -> None:
    study_id, workers = start(coordinator, four_sites, tmp_path, sites=("a", "b"), keep_updates=True)
    outsider = enrol(coordinator, "outsider")
    for worker in workers.values():
        worker.approvals.sync(worker.client)  # its operator approved the study: its tasks are on offer
    task = coordinator.get("/api/v1/tasks/next", headers=workers["a"].client.http.headers).json()
    url, update_url = task["secure"]["url"], task["update_url"]
    headers = dict(workers["a"].client.http.headers)
    key = base64.b64encode(bytes(range(32))).decode()
    advert = {
        "cipher_public": key,
        "mask_public": key,
        "num_examples": 10,
        "metrics": {"loss": 0.5},
        "train_seconds": 1,
        "global_sha256": task["global_model_sha256"],
        "signature": "00" * 64,
    }

    wrong_phase = _site_post(coordinator, headers, f"{url}/shares", {"shares": []})
    assert (wrong_phase.status_code, wrong_phase.json()["error"]["code"]) == (409, "wrong_phase")
    not_participant = _site_post(coordinator, outsider, f"{url}/advertisement", advert)
    assert (not_participant.status_code, not_participant.json()["error"]["code"]) == (403, "not_a_participant")
    with_stats = _site_post(
        coordinator, headers, f"{url}/advertisement", {**advert, "metrics": {"loss": 0.5, "eval_stats": {}}}
    )
    assert with_stats.status_code == 422 and "never sent in the clear" in with_stats.text
    short_key = _site_post(coordinator, headers, f"{url}/advertisement", {**advert, "cipher_public": "AAAA"})
    assert short_key.status_code == 422 and "32 bytes" in short_key.text
    forged = _site_post(coordinator, headers, f"{url}/advertisement", advert)  # not signed by a's key
    assert forged.status_code == 422 and "not signed by its signing key" in forged.text
    other_model = {**advert, "global_sha256": "f" * 64}
    assert _site_post(coordinator, headers, f"{url}/advertisement", other_model).status_code == 422
    early = coordinator.post(
        update_url, content=b"\0" * 16, headers={**headers, "Content-Type": "application/octet-stream"}
    )
    assert (early.status_code, early.json()["error"]["code"]) == (409, "wrong_phase")

    cycle(workers)  # both train and advertise (a's task is still on offer: it had sent nothing valid)
    again = _site_post(coordinator, headers, f"{url}/advertisement", advert)
    assert (again.status_code, again.json()["error"]["code"]) == (409, "duplicate_message")
    stranger = {"shares": [{"receiver": 7, "ciphertext": "AAAA"}]}
    to_stranger = _site_post(coordinator, headers, f"{url}/shares", stranger)
    assert (to_stranger.status_code, to_stranger.json()["error"]["code"]) == (422, "invalid_secagg_message")
    assert "must go once to each of" in to_stranger.text
    cycle(workers)  # both share: phase 2
    late = _site_post(coordinator, headers, f"{url}/shares", stranger)
    assert (late.status_code, late.json()["error"]["code"]) == (409, "duplicate_message")
    meta = UpdateMeta(
        num_examples=workers["a"].secure.result.meta.num_examples, metrics=UpdateMetrics(loss=0.1), train_seconds=0
    )
    for tensor, code in [
        (torch.zeros(5, dtype=torch.int64), 422),  # wrong shape
        (torch.zeros(5, dtype=torch.float32), 422),  # wrong dtype
    ]:
        refused = coordinator.post(
            update_url,
            content=encode_update({MASKED_TENSOR: tensor}, meta),
            headers={**headers, "Content-Type": "application/octet-stream"},
        )
        assert refused.status_code == code, refused.text
    cycle(workers)  # mask
    cycle(workers)  # sign the survivor set
    cycle(workers)  # reveal
    shown = rounds(coordinator, study_id)[0]
    assert shown["status"] == "completed", shown["note"]
    plain = coordinator.get(f"/api/v1/rounds/{shown['id']}/secagg", headers=headers)
    assert plain.json()["status"] == "completed"

    state = coordinator.app.state.coordinator  # the database holds masked vectors only, never an update in the clear
    with state.sessions() as session:
        store, engine = blob_store_of(session), session.get_bind().engine
    digests = [u["sha256"] for u in shown["updates"]]
    with open_blobs(engine, digests, store=store) as readers:
        for reader in readers:
            tensors, _ = load(bytearray(reader.read(0, reader.size)))
            assert set(tensors) == {MASKED_NARROW, MASKED_TENSOR}  # the model's changes in Z_2^32, the rest in Z_2^64
            assert tensors[MASKED_NARROW].dtype == torch.int32 and tensors[MASKED_TENSOR].dtype == torch.int64


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"min_sites": 1}, "min_sites >= 2"),
        (
            {"sites": [f"s{i}" for i in range(8)], "min_sites": 2, "participation": {"name": "random"}},
            "2 colluding sites need a threshold of at least 2, more than the 1 neighbours",
        ),  # rounds of two sites: k = 1
        (
            {
                "privacy": {"secure_aggregation": {"neighbour_count": 3}},
                "sites": ["a", "b", "c", "d", "e", "f"],
                "min_sites": 5,
            },
            "must be even",
        ),
        ({"privacy": {"secure_aggregation": {"threshold": 3}}}, "cannot exceed it"),
        (
            {"sites": [f"s{i}" for i in range(8)], "min_sites": 6, "privacy": {"secure_aggregation": {"threshold": 4}}},
            r"split the honest neighbours and rebuild both of a site's secrets: t must be at least .* = 5",
        ),  # k = 7, c = 2: 2t > 9
        ({"privacy": {"secure_aggregation": {"colluding": 2}}}, "fewer than two honest"),
        ({"privacy": {"secure_aggregation": {"fraction_bits": 29}}}, "does not fit a 32-bit ring"),
        ({"privacy": {"secure_aggregation": {"ring_bits": 16}}}, "32 or 64"),
        (
            {
                "aggregation": {"name": "equal"},
                "privacy": {
                    "secure_aggregation": {},
                    "dp": {"noise_multiplier": 1.0, "clip_norm": 10.0, "mode": "distributed"},
                },
            },
            "3 clipped and noised changes may reach 237.8 per value, beyond the 32-bit ring's 64",
        ),
    ],
)
def test_studies_secure_aggregation_cannot_serve_are_refused(changes: dict, message: str) -> None:
    config = {
        "model": {"preset": "tiny", "heads": "6:2"},
        "sites": ["a", "b", "c"],
        "min_sites": 2,
        "privacy": {"secure_aggregation": {}},
        **changes,
    }
    if "secure_aggregation" not in config["privacy"]:
        config["privacy"] = {"secure_aggregation": {}}
    with pytest.raises((ValidationError, TermsError), match=message):
        checked_terms(config)


@pytest.mark.parametrize("ring_bits", [32, 64])
def test_the_library_sum_matches_within_the_stated_bound(ring_bits: int) -> None:
    from cardiofl.experiment.secure_simulation import simulate_secure_sum
    from shared.algorithms.server import ServerAggregator
    from shared.errors import PrivacyInputError
    from shared.study.secagg import SecureLayout, decode_sum, site_vector
    from shared.tensors.codec import TensorSpec

    schema = {"w": TensorSpec((50,), torch.float32), "n": TensorSpec((), torch.int64)}
    layout = SecureLayout.of(schema, 2, 24, narrow=lambda name: ring_bits == 32 and name == "w")
    narrow = 50 if ring_bits == 32 else 0
    assert (layout.narrow_length, layout.wide_length) == (narrow, layout.length - narrow)
    rng = np.random.default_rng(0)
    base = {"w": torch.from_numpy(rng.normal(size=50).astype(np.float32)) * 100}  # theta^g, far outside +-64
    tensors = {
        k: {"w": base["w"] + torch.from_numpy(rng.normal(size=50).astype(np.float32)), "n": torch.tensor(3 + k)}
        for k in (1, 2, 3)
    }
    weights = {1: 0.2, 2: 0.3, 3: 0.5}
    ring = {k: site_vector(layout, tensors[k], weights[k], None, base=base) for k in tensors}
    summed = simulate_secure_sum(ring, dropped_after_sharing=[3], neighbour_count=2, threshold=1)
    if ring_bits == 32:
        with pytest.raises(PrivacyInputError, match="change from theta"):
            decode_sum(layout, summed.ring_sum, 2)  # the sum of changes means nothing without theta^g
        with pytest.raises(PrivacyInputError, match="change from theta"):
            site_vector(layout, tensors[1], weights[1], None)
    decoded = decode_sum(layout, summed.ring_sum, 2, base=base)
    aggregator = ServerAggregator()
    aggregator.take_sums(decoded.schema, decoded.sums, decoded.weight_sum, 2)
    average = aggregator.result()
    expected = (0.2 * tensors[1]["w"].double() + 0.3 * tensors[2]["w"].double()) / 0.5
    error = (average["w"].double() - expected).abs()
    assert bool((error <= decoded.error_bound + 2.0**-24 * expected.abs() + 1e-7).all())  # and float32's rounding
    assert int(average["n"]) == round((0.2 * 4 + 0.3 * 5) / 0.5)


@pytest.mark.parametrize("algorithm", ["scaffold", "scaffold_fedcvd"])
def test_secure_scaffold_takes_the_plain_server_step_on_the_unmasked_sums(
    coordinator: TestClient, four_sites: dict[str, SiteData], tmp_path: Path, algorithm: str
) -> None:
    spec = {"name": algorithm, "params": {"server_lr": 0.5}}
    study_id, workers = start(coordinator, four_sites, tmp_path, algorithm=spec)
    cycle(workers)  # train and advertise
    trained = {name: w.secure.result for name, w in workers.items() if w.secure is not None}
    cycle(workers)  # share
    survivors = sorted(set(SITES) - {"c"})  # c drops after sharing: its masks are removed, its Delta c is not summed
    cycle(workers, set(survivors))  # mask
    past_phase_deadline(coordinator)
    cycle(workers, set(survivors))  # sign the survivor set
    cycle(workers, set(survivors))  # reveal
    assert rounds(coordinator, study_id)[0]["status"] == "completed", rounds(coordinator, study_id)[0]["note"]

    config = StudyTerms.model_validate({**study_values(algorithm=spec), "sites": list(SITES)})
    names = sorted(trained)
    weights = dict(zip(names, aggregation_weights([trained[n].meta.num_examples for n in names]), strict=True))
    plain = next_global(
        server_aggregator(config), model(coordinator, study_id, 0), [(trained[n].shared, weights[n]) for n in survivors]
    )
    secure = model(coordinator, study_id, 1)
    assert secure.keys() == plain.keys() and any(n.startswith(SCAFFOLD_C) for n in secure)
    total = sum(weights[n] for n in survivors)
    bound = len(survivors) * 2.0**-25  # on each coordinate of the (weighted or Delta c) sum
    for name, tensor in secure.items():
        if not tensor.is_floating_point():
            continue  # integer buffers: the rounded weighted mean under masking, the maximum in the clear
        step = bound / 4 if name.startswith(SCAFFOLD_C) else 0.5 * bound / total  # c += sum / N; x moves by server_lr
        assert torch.allclose(tensor.double(), plain[name].double(), rtol=1e-5, atol=step + 1e-6), name
    nonzero = [n for n in secure if n.startswith(SCAFFOLD_C) and bool(secure[n].abs().sum() > 0)]
    assert nonzero, "the server control variate moved"


def test_a_site_whose_change_exceeds_the_32_bit_range_leaves_the_round_and_the_others_release_it(
    coordinator: TestClient, four_sites: dict[str, SiteData], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    study_id, workers = start(coordinator, four_sites, tmp_path)
    cycle(workers)  # train and advertise
    trained = {name: w.secure.result for name, w in workers.items() if w.secure is not None}
    name = next(n for n, t in trained["c"].shared.items() if t.is_floating_point())
    trained["c"].shared[name].add_(100.0)  # beyond 2^(30 - 24) = 64 from theta^g: c cannot encode its change
    cycle(workers)  # share
    with caplog.at_level("WARNING"):
        cycle(workers)  # mask: c refuses and leaves, having sent nothing masked
    assert "leaving the round" in caplog.text and "exceed 64" in caplog.text
    assert workers["c"].secure is None
    survivors = {"a", "b", "d"}
    past_phase_deadline(coordinator)
    cycle(workers, survivors)  # sign the survivor set
    cycle(workers, survivors)  # reveal, c's pairwise masks included
    shown = rounds(coordinator, study_id)[0]
    assert shown["status"] == "completed", shown["note"]
    assert sorted(u["site"] for u in shown["updates"]) == sorted(survivors)
    names = sorted(trained)
    weights = dict(zip(names, aggregation_weights([trained[n].meta.num_examples for n in names]), strict=True))
    total = sum(weights[n] for n in survivors)
    released = model(coordinator, study_id, 1)
    for tensor_name, tensor in released.items():
        if tensor.is_floating_point():
            expected = sum(weights[n] * trained[n].shared[tensor_name].double() for n in survivors) / total
            assert torch.allclose(tensor.double(), expected, rtol=1e-5, atol=3 * 2.0**-25 / total + 1e-6)


def test_distributed_dp_noise_of_the_honest_survivors_alone_reaches_z_c(
    coordinator: TestClient, four_sites: dict[str, SiteData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = iter(range(1, 100))  # each site its own seeded noise: independent draws, repeatable
    monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda _key: DiscreteGaussian(bytes([next(keys)]) * 32))
    dp = {"noise_multiplier": 1.1, "clip_norm": 0.05, "delta": 1e-5, "mode": "distributed"}
    changes = {"aggregation": {"name": "equal"}, "privacy": privacy(colluding=1, dp=dp)}
    study_id, workers = start(coordinator, four_sites, tmp_path, **changes)
    cycle(workers)  # train and advertise
    quorum = workers["a"].secure.task.secure.min_survivors  # type: ignore[union-attr]
    assert round_quorum(3, quorum) == quorum == 4  # four sites against c = 1: k = 3, t = q = 3, every site survives
    assert workers["a"].secure.spec.quorum == 3  # type: ignore[union-attr]  # noise for 4 less c = 1 colluder
    survivors = set(SITES)  # the fewest allowed
    cycle(workers, survivors)  # share
    cycle(workers, survivors)  # mask
    cycle(workers, survivors)  # sign the survivor set
    cycle(workers, survivors)  # reveal
    assert rounds(coordinator, study_id)[0]["status"] == "completed", rounds(coordinator, study_id)[0]["note"]
    previous, released = model(coordinator, study_id, 0), model(coordinator, study_id, 1)
    # released = previous + mean over the survivors of (clipped update + noise share): the sum's noise is
    # len(survivors) * (released - previous) less the clipped updates, whose norm is at most C each
    moved = np.concatenate(
        [
            (len(survivors) * (released[n].double() - previous[n].double())).reshape(-1).numpy()
            for n in released
            if released[n].is_floating_point()
        ]
    )
    signal = len(survivors) * dp["clip_norm"] / np.sqrt(moved.size)  # RMS per coordinate of the clipped sum, at most
    sigma_c = dp["noise_multiplier"] * float(norm_bound(dp["clip_norm"], moved.size, 24)) * 2.0**-24  # z Delta
    assert moved.size > 10_000 and signal < 0.05 * sigma_c
    share = moved.std() / np.sqrt(len(survivors))  # each of the four survivors' shares: z C / sqrt(4 - 1)
    assert share == pytest.approx(sigma_c / np.sqrt(3), rel=0.02)
    honest = share * np.sqrt(len(survivors) - 1)  # the coordinator knows one colluder's share and subtracts it
    assert honest >= 0.98 * sigma_c and honest == pytest.approx(sigma_c, rel=0.02)


def test_an_agent_restarted_after_advertising_drops_out_and_takes_the_next_round(
    client: TestClient, four_sites: dict[str, SiteData], tmp_path: Path
) -> None:
    study_id, workers = start(client, four_sites, tmp_path, rounds=2)
    cycle(workers)  # all train and advertise
    old = workers["c"]
    assert old.secure is not None
    headers = dict(old.client.http.headers)
    workers["c"], recorder = make_worker(client, "c", headers, tmp_path / "c", b"k" * 32, four_sites["c"])
    assert workers["c"].secure is None  # the round's secrets died with the process; its store is the same
    for _ in range(4):
        cycle(workers)  # share, mask, sign, reveal: c is offered nothing of round 1 and sends nothing
    past_phase_deadline(client)  # phase 1 waited for c, which advertised
    for _ in range(4):
        cycle(workers)
    first = rounds(client, study_id)[0]
    assert first["status"] == "completed", first["note"]
    assert sorted(u["site"] for u in first["updates"]) == ["a", "b", "d"]
    sent_in_round_1 = [url for url, _ in recorder.bodies if f"/rounds/{first['id']}/" in url]
    assert sent_in_round_1 == []  # no second advertisement, no share or upload the protocol would refuse

    for _ in range(8):
        if client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] != "running":
            break
        cycle(workers)
    second = rounds(client, study_id)[1]
    assert second["status"] == "completed", second["note"]
    assert sorted(u["site"] for u in second["updates"]) == list(SITES)


def test_a_waiting_secure_round_read_answers_once_the_phase_moves_on(
    database_url: str, four_sites: dict[str, SiteData], tmp_path: Path
) -> None:
    settings = coordinator_settings_for(database_url, task_poll_interval_s=60.0, max_poll_wait_s=60.0)
    with TestClient(create_app(settings)) as client:
        _, workers = start(client, four_sites, tmp_path, sites=("a", "b"))
        cycle(workers)  # both advertise: phase 1 (share)
        url = workers["a"].secure.url
        headers = {name: dict(worker.client.http.headers) for name, worker in workers.items()}
        started = time.monotonic()
        turn = client.get(f"{url}?wait=50", headers=headers["b"])  # b has its shares to send: no wait
        assert turn.json()["phase"] == 1 and time.monotonic() - started < 30
        cycle(workers, {"a"})  # a shares, then can only wait for b
        answers = []
        poller = threading.Thread(target=lambda: answers.append(client.get(f"{url}?wait=50", headers=headers["a"])))
        poller.start()
        time.sleep(0.5)  # the read has looked once, found nothing for a to do, and waits
        assert not answers
        started = time.monotonic()
        cycle(workers, {"b"})  # b shares: phase 2 (mask) opens
        poller.join(timeout=60)
        waited = time.monotonic() - started
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].json()["phase"] == 2 and answers[0].json()["shares"]
    assert waited < 30  # woken by the phase change, not by its 60-second poll interval


@pytest.mark.parametrize("weighting", ["samples", "uncertainty"])
def test_peers_are_relayed_n_k_and_what_the_weighting_reads_only(
    coordinator: TestClient, four_sites: dict[str, SiteData], tmp_path: Path, weighting: str
) -> None:
    """The coordinator takes each site's scalar metrics; another site sees n_k and H_k (uncertainty) of it, no more."""
    study_id, workers = start(coordinator, four_sites, tmp_path, aggregation={"name": weighting})
    cycle(workers)  # train and advertise: phase 1 opens
    url, a = workers["a"].secure.url, workers["a"]  # type: ignore[union-attr]
    view = coordinator.get(url, headers=dict(a.client.http.headers)).json()
    reads = {"samples": set(), "uncertainty": {"entropy"}}[weighting]
    fields = {"site", "cipher_public", "mask_public", "num_examples", "report", "global_sha256", "signature"}
    assert len(view["peers"]) == len(SITES)
    for peer in view["peers"]:
        assert set(peer) == fields and set(peer["report"]) == reads, peer
    assert not any(word in json.dumps(view) for word in ("loss", "micro_f1", "train_seconds", "local_eval")), view
    for _ in range(4):  # share, mask, sign, reveal: every signature over the relayed report holds
        cycle(workers)
    shown = rounds(coordinator, study_id)[0]
    assert shown["status"] == "completed", shown["note"]
    assert all(u["train_loss"] >= 0 for u in shown["updates"])  # the coordinator keeps the scalars it took


def test_theta_g_is_added_back_a_window_at_a_time_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    from cardiofl.experiment.secure_simulation import simulate_secure_sum
    from shared.study import secagg
    from shared.tensors.codec import TensorSpec

    schema = {"w": TensorSpec((7, 11), torch.float32), "v": TensorSpec((5,), torch.float16)}
    layout = secagg.SecureLayout.of(schema, 2, 24, narrow=lambda name: True)
    rng = np.random.default_rng(4)
    base = {name: torch.from_numpy(rng.normal(size=spec.shape)).to(spec.dtype) * 50 for name, spec in schema.items()}
    sites = {k: {name: tensor + 0.1 * k for name, tensor in base.items()} for k in (1, 2)}
    ring = {k: secagg.site_vector(layout, tensors, 0.5, None, base=base) for k, tensors in sites.items()}
    summed = simulate_secure_sum(ring, neighbour_count=1, threshold=1)
    whole = secagg.decode_sum(layout, summed.ring_sum, 2, base=base)
    monkeypatch.setattr(secagg, "DECODE_WINDOW", 4)  # windows that end mid-row, a short one last
    windowed = secagg.decode_sum(layout, summed.ring_sum, 2, base=base)
    for name in schema:
        assert torch.equal(windowed.sums[name], whole.sums[name]) and windowed.sums[name].dtype == torch.float64
        expected = sum(0.5 * tensors[name].double() for tensors in sites.values())  # sum_k w_k theta_k
        assert bool(((windowed.sums[name] - expected).abs() <= 2 * whole.error_bound + 1e-9).all())
