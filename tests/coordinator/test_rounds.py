import hashlib
import re
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import utc_now
from coordinator.main import create_app
from coordinator.models import AuditEvent, GlobalModel, Round
from coordinator.rounds import closing, plain
from coordinator.rounds.closing import tick
from coordinator.storage import stored_updates
from coordinator.storage.blobs import BlobReader
from shared.evaluation.summaries import contribution_summary, mean_summary, pooled_summary
from shared.study.rules import initial_state
from shared.tensors import windows as tensor_windows
from shared.tensors.codec import load
from shared.terms import StudyTerms
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import (
    ADMIN,
    download,
    eval_stats,
    evaluate_and_upload,
    expected_average,
    local_eval,
    next_task,
    running_study,
    shifted,
    train_and_upload,
    update_body,
    upload,
)


def _round(client: TestClient, study_id: int, number: int) -> dict:
    response = client.get(f"/api/v1/studies/{study_id}/rounds/{number}", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def _tick_after_deadline(client: TestClient, seconds: float = 61.0) -> None:
    state = client.app.state.coordinator
    tick(state.sessions, now=utc_now() + timedelta(seconds=seconds), lease_s=state.settings.aggregation_lease_s)


def test_round_completes_when_every_participant_reported(client: TestClient) -> None:
    study_id, headers = running_study(client)
    base = download(client, f"/api/v1/studies/{study_id}/models/0", ADMIN)
    assert train_and_upload(client, headers["lyon"], 1.0, 10).status_code == 201
    assert _round(client, study_id, 1)["status"] == "open"
    assert train_and_upload(client, headers["oslo"], 3.0, 30).status_code == 201
    done = _round(client, study_id, 1)
    assert done["status"] == "completed"
    assert {u["site"]: u["weight"] for u in done["updates"]} == pytest.approx({"lyon": 0.25, "oslo": 0.75})
    # theta^g_1 against a hand-rolled reference: floats 0.25*(+1) + 0.75*(+3) = +2.5, integers the max (+3)
    actual = download(client, f"/api/v1/studies/{study_id}/models/1", ADMIN)
    expected = expected_average([(shifted(base, 1.0), 0.25), (shifted(base, 3.0), 0.75)])
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-6)
    tracked = [n for n in actual if n.endswith("num_batches_tracked")]
    assert tracked and all(int(actual[n]) == int(base[n]) + 3 for n in tracked)
    assert done["global_model_sha256"] == _round(client, study_id, 2)["base_sha256"]
    assert _round(client, study_id, 2)["status"] == "open"


def test_equal_weighting_ignores_sample_counts(client: TestClient) -> None:
    study_id, headers = running_study(client, aggregation={"name": "equal"})
    train_and_upload(client, headers["lyon"], 1.0, 10)
    train_and_upload(client, headers["oslo"], 3.0, 30)
    assert [u["weight"] for u in _round(client, study_id, 1)["updates"]] == pytest.approx([0.5, 0.5])


def test_last_round_opens_the_final_evaluation_then_completes_the_study(client: TestClient) -> None:
    study_id, headers = running_study(client, rounds=2)
    for _ in range(2):
        for site in ("lyon", "oslo"):
            assert train_and_upload(client, headers[site], 0.1, 5).status_code == 201
    study = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert study["status"] == "running" and study["completed_rounds"] == 2 and study["current_round"] == 3
    task = next_task(client, headers["lyon"])
    assert task["kind"] == "evaluate" and task["global_model_round"] == 2 and task["load_factor"] == 1.0
    # the evaluation round takes statistics only: tensors are refused
    with_tensors = train_and_upload(client, headers["lyon"], 0.1, 5)
    assert with_tensors.status_code == 422 and with_tensors.json()["error"]["code"] == "unexpected_tensors"
    stats = eval_stats(seed=1).to_dict()
    for site in ("lyon", "oslo"):
        assert evaluate_and_upload(client, headers[site], eval_stats=stats).status_code == 201
    study = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert study["status"] == "completed" and study["completed_rounds"] == 2 and study["current_round"] is None
    assert client.get("/api/v1/tasks/next", headers=headers["lyon"]).status_code == 204
    models = client.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()
    assert [m["round"] for m in models["data"]] == [0, 1, 2]
    final = _round(client, study_id, 3)  # nothing trained in it: no train loss, pooled or per site
    assert final["kind"] == "evaluate" and final["pooled"]["train_loss"] is None
    assert [u["train_loss"] for u in final["updates"]] == [None, None]
    assert _round(client, study_id, 2)["pooled"]["train_loss"] is not None


def test_deadline_with_quorum_aggregates_the_updates_received(client: TestClient) -> None:
    study_id, headers = running_study(client, sites=("lyon", "oslo", "graz"), min_sites=2)
    train_and_upload(client, headers["lyon"], 1.0, 10)
    train_and_upload(client, headers["oslo"], 2.0, 10)
    _tick_after_deadline(client, seconds=30)  # before the deadline: nothing happens
    assert _round(client, study_id, 1)["status"] == "open"
    _tick_after_deadline(client)
    done = _round(client, study_id, 1)
    assert done["status"] == "completed"
    assert {u["site"] for u in done["updates"]} == {"lyon", "oslo"}
    # graz's task moved on to round 2; a late upload to round 1 is refused
    assert next_task(client, headers["graz"])["round"] == 2


def test_deadline_below_quorum_fails_and_retries_the_round(client: TestClient, sessions) -> None:
    study_id, headers = running_study(client, min_sites=2, round_retries=1)
    train_and_upload(client, headers["lyon"], 1.0, 10)
    _tick_after_deadline(client)
    rounds = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert [(r["number"], r["attempt"], r["status"]) for r in rounds] == [(1, 1, "failed"), (1, 2, "open")]
    assert "quorum missed: 1 of 2" in rounds[0]["note"]
    assert rounds[1]["base_sha256"] == rounds[0]["base_sha256"]
    task = next_task(client, headers["lyon"])  # lyon must train again for the new attempt
    assert (task["round"], task["attempt"], task["round_id"]) == (1, 2, rounds[1]["id"])


def test_retries_spent_fail_the_study(client: TestClient, sessions: sessionmaker[Session]) -> None:
    study_id, _ = running_study(client, min_sites=1, round_retries=0)
    _tick_after_deadline(client)
    study = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert study["status"] == "failed"
    with sessions() as session:
        actions = session.scalars(select(AuditEvent.action).where(AuditEvent.study_id == study_id)).all()
    assert actions[-2:] == ["round.failed", "study.failed"]


def test_paused_study_neither_hands_out_tasks_nor_closes_rounds(client: TestClient) -> None:
    study_id, headers = running_study(client)
    task = next_task(client, headers["lyon"])
    assert client.post(f"/api/v1/studies/{study_id}/pause", headers=ADMIN).json()["status"] == "paused"
    assert client.get("/api/v1/tasks/next", headers=headers["oslo"]).status_code == 204
    base = download(client, task["global_model_url"], headers["lyon"])
    assert upload(client, task, headers["lyon"], update_body(base, 4)).status_code == 201  # still counts
    _tick_after_deadline(client, seconds=3600)
    assert _round(client, study_id, 1)["status"] == "open"
    resumed = client.post(f"/api/v1/studies/{study_id}/resume", headers=ADMIN).json()
    assert resumed["status"] == "running" and resumed["current_round"] == 1
    assert next_task(client, headers["oslo"])["round"] == 1


def test_round_zero_is_the_seeded_model_split_into_theta_and_phi(client: TestClient) -> None:
    study_id, headers = running_study(client, seed=7)
    config = StudyTerms.model_validate(client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["config"])
    theta, phi = initial_state(config)
    task = next_task(client, headers["lyon"])
    got_theta = download(client, task["global_model_url"], headers["lyon"])
    got_phi = download(client, task["initial_local_url"], headers["lyon"])
    assert got_theta.keys() == theta.keys() and got_phi.keys() == phi.keys() and phi
    assert all(torch.equal(got_theta[n], theta[n]) for n in theta)
    assert all(torch.equal(got_phi[n], phi[n]) for n in phi)
    assert task["global_model_round"] == 0 and task["load_factor"] == 1.0


def test_global_model_download_uses_sha256_etags(client: TestClient) -> None:
    study_id, headers = running_study(client)
    url = f"/api/v1/studies/{study_id}/models/0"
    first = client.get(url, headers=headers["lyon"])
    etag = first.headers["etag"]
    assert etag == f'"{hashlib.sha256(first.content).hexdigest()}"'
    cached = client.get(url, headers={**headers["lyon"], "If-None-Match": etag})
    assert cached.status_code == 304 and cached.content == b""
    stale = client.get(url, headers={**headers["lyon"], "If-None-Match": '"0000"'})
    assert stale.status_code == 200 and stale.content == first.content
    assert client.get(f"/api/v1/studies/{study_id}/models/1", headers=ADMIN).status_code == 404
    assert client.get(f"/api/v1/studies/{study_id}/models/1/local", headers=ADMIN).status_code == 404
    assert load(client.get(f"/api/v1/studies/{study_id}/models/0/local", headers=ADMIN).content)[0]


def test_rounds_expose_per_site_and_pooled_summaries(client: TestClient) -> None:
    study_id, headers = running_study(client)
    local = {"lyon": local_eval(3), "oslo": local_eval(4, n_samples=60)}
    train_and_upload(client, headers["lyon"], 0.1, 10, loss=0.2, local_eval=local["lyon"])
    open_round = _round(client, study_id, 1)  # pooled over what arrived so far
    assert open_round["pooled"]["local_eval"]["n_samples"] == 40
    train_and_upload(client, headers["oslo"], 0.1, 30, loss=0.6)
    done = _round(client, study_id, 1)
    by_site = {u["site"]: u for u in done["updates"]}
    assert by_site["lyon"]["local_eval"] == local["lyon"]  # the site's exact scalars, as sent
    assert by_site["oslo"]["local_eval"] is None and by_site["lyon"]["train_loss"] == 0.2
    assert done["pooled"]["train_loss"] == pytest.approx((10 * 0.2 + 30 * 0.6) / 40)
    assert done["pooled"]["local_eval"] == {**local["lyon"], "n_sites": 1}
    # theta^g_1 is evaluated by the sites when they receive it, in round 2: round 1 shows it then
    assert done["pooled"]["eval"] is None and by_site["lyon"]["eval"] is None
    of_theta_1 = {"lyon": eval_stats(1), "oslo": eval_stats(2, n_samples=60)}
    train_and_upload(
        client, headers["lyon"], 0.1, 10, eval_stats=of_theta_1["lyon"].to_dict(), local_eval=local["lyon"]
    )
    assert _round(client, study_id, 1)["pooled"]["eval"] == pooled_summary([of_theta_1["lyon"]])
    train_and_upload(
        client, headers["oslo"], 0.1, 30, eval_stats=of_theta_1["oslo"].to_dict(), local_eval=local["oslo"]
    )
    assert _round(client, study_id, 2)["pooled"]["local_eval"] == mean_summary(local.values())
    first = _round(client, study_id, 1)
    by_site = {u["site"]: u for u in first["updates"]}
    assert by_site["lyon"]["eval"] == contribution_summary(of_theta_1["lyon"])
    assert by_site["oslo"]["eval"] == contribution_summary(of_theta_1["oslo"])
    assert first["pooled"]["eval"] == pooled_summary(of_theta_1.values())
    assert first["pooled"]["eval"]["micro_f1"] == (of_theta_1["lyon"] + of_theta_1["oslo"]).summary()["micro_f1"]
    assert _round(client, study_id, 2)["pooled"]["eval"] is None  # theta^g_2 awaits the final evaluation
    listed = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"][0]
    assert listed["pooled"] == first["pooled"]
    # the final evaluation round reports theta^g_2; oslo has too few test records to contribute
    lyon_final = eval_stats(5)
    assert evaluate_and_upload(client, headers["lyon"], eval_stats=lyon_final.to_dict()).status_code == 201
    marker = {"too_few_records": True}
    assert evaluate_and_upload(client, headers["oslo"], eval_stats=marker).status_code == 201
    last = _round(client, study_id, 2)
    assert last["pooled"]["eval"] == pooled_summary([lyon_final, None])
    assert last["pooled"]["eval"]["n_sites"] == 1 and last["pooled"]["eval"]["n_sites_too_few"] == 1
    assert last["pooled"]["eval"]["n_samples"] == 40 and last["pooled"]["eval"]["map"] == lyon_final.summary()["map"]
    assert {u["site"]: u["eval"] for u in last["updates"]}["oslo"] == marker
    assert _round(client, study_id, 3)["kind"] == "evaluate"


def test_undefined_metrics_summarise_to_null_not_nan(client: TestClient) -> None:
    study_id, headers = running_study(client, rounds=1)
    scalars = {"n_samples": 5, "loss": 0.3, "micro_f1": 0.0, "map": 0.0, "map_present": None}  # no positives
    train_and_upload(client, headers["lyon"], 0.1, 10, local_eval=scalars)
    assert _round(client, study_id, 1)["updates"][0]["local_eval"]["map_present"] is None
    train_and_upload(client, headers["oslo"], 0.1, 10)
    for site in ("lyon", "oslo"):  # no site has enough test records to pool
        assert evaluate_and_upload(client, headers[site], eval_stats={"too_few_records": True}).status_code == 201
    pooled = _round(client, study_id, 1)["pooled"]["eval"]
    assert pooled["n_samples"] == 0 and pooled["n_sites"] == 0 and pooled["n_sites_too_few"] == 2
    assert pooled["loss"] is None and pooled["micro_f1"] is None and pooled["map"] is None


def test_every_transition_is_audited(client: TestClient, sessions: sessionmaker[Session]) -> None:
    study_id, headers = running_study(client, rounds=1)
    train_and_upload(client, headers["lyon"], 0.1, 10)
    train_and_upload(client, headers["oslo"], 0.1, 10)
    evaluate_and_upload(client, headers["lyon"])
    evaluate_and_upload(client, headers["oslo"])
    with sessions() as session:
        events = session.scalars(
            select(AuditEvent).where(AuditEvent.study_id == study_id).order_by(AuditEvent.id)
        ).all()
        model = session.scalar(select(GlobalModel).where(GlobalModel.round_number == 1))
        round_id = session.scalar(select(Round.id))
    assert [e.action for e in events] == [
        "study.created",
        "site.approved",  # both sites approved the study before it started
        "site.approved",
        "study.running",
        "round.opened",
        "update.accepted",
        "update.accepted",
        "round.aggregating",
        "round.completed",
        "round.opened",  # the final evaluation round
        "update.accepted",
        "update.accepted",
        "round.aggregating",
        "round.completed",
        "study.completed",
    ]
    assert events[9].detail["kind"] == "evaluate"
    completed = events[8]
    assert completed.digest == model.sha256 and completed.round_id == round_id
    assert completed.detail["weights"] == {"lyon": 0.5, "oslo": 0.5}
    assert events[3].actor == "admin:env" and events[5].actor.startswith("site:")
    assert events[1].actor.startswith("site:") and len(events[1].digest) == 64


def test_aggregation_reads_each_stored_update_once_a_piece_at_a_time(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, headers = running_study(client, sites=("a1", "a2", "a3", "a4"))
    monkeypatch.setattr(tensor_windows, "PIECE_BYTES", 4096)
    reads: list[int] = []
    real_open = stored_updates.open_blobs

    @contextmanager
    def tracked_open(engine, digests, *, prefetch, store):
        def tracked(blob: BlobReader) -> BlobReader:
            return BlobReader(blob.size, lambda offset, size: reads.append(size) or blob.read(offset, size))

        with real_open(engine, digests, prefetch=prefetch, store=store) as blobs:
            yield [tracked(blob) for blob in blobs]

    monkeypatch.setattr(stored_updates, "open_blobs", tracked_open)
    for index, site in enumerate(("a1", "a2", "a3", "a4")):
        train_and_upload(client, headers[site], float(index), 10)
    round_ = _round(client, study_id, 1)
    assert round_["status"] == "completed"
    sizes = [update["size"] for update in round_["updates"]]
    assert sum(reads) == sum(size + 8 for size in sizes)  # every byte once, the 8-byte header length twice
    assert max(reads) < min(sizes)  # no update was ever read (held in memory) whole


def test_background_ticker_closes_a_round_at_its_deadline(database_url: str) -> None:
    settings = coordinator_settings_for(database_url, tick_interval_s=0.05)
    with TestClient(create_app(settings)) as client:
        study_id, headers = running_study(client, sites=("lyon", "oslo"), round_deadline_s=2.0)
        train_and_upload(client, headers["lyon"], 1.0, 10)
        give_up = time.monotonic() + 20
        while _round(client, study_id, 1)["status"] in ("open", "aggregating"):
            assert time.monotonic() < give_up, "the ticker did not close the round"
            time.sleep(0.05)
        assert _round(client, study_id, 1)["status"] == "completed"
        assert [u["site"] for u in _round(client, study_id, 1)["updates"]] == ["lyon"]


def test_a_round_that_reached_quorum_meanwhile_is_not_failed(client: TestClient) -> None:
    study_id, headers = running_study(client, min_sites=1)
    round_id = next_task(client, headers["lyon"])["round_id"]
    train_and_upload(client, headers["lyon"], 1.0, 10)  # arrives after a check that counted none
    state = client.app.state.coordinator
    assert not closing._fail_round(state.sessions, round_id, now=utc_now(), reason="quorum missed: 0 of 2")
    assert _round(client, study_id, 1)["status"] == "open"


def test_the_aggregation_time_is_measured_and_exported(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    real_add = plain.add_stored_updates

    def slow_add(*args, **kwargs) -> None:
        time.sleep(0.25)
        real_add(*args, **kwargs)

    monkeypatch.setattr(plain, "add_stored_updates", slow_add)
    study_id, headers = running_study(client, sites=("lyon",))
    train_and_upload(client, headers["lyon"], 1.0, 10)
    assert _round(client, study_id, 1)["status"] == "completed"
    metrics = client.get("/metrics", headers=ADMIN).text
    count = float(re.search(r"^cardiofl_aggregation_seconds_count (\S+)$", metrics, re.M).group(1))
    total = float(re.search(r"^cardiofl_aggregation_seconds_sum (\S+)$", metrics, re.M).group(1))
    assert count == 1.0 and 0.25 <= total < 30


def test_each_round_is_logged_when_it_opens_and_completes(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="coordinator.rounds")
    study_id, headers = running_study(client, sites=("lyon",))
    train_and_upload(client, headers["lyon"], 1.0, 10)
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("coordinator.rounds.")]
    assert any(f"study {study_id}: train round 1 (attempt 1) opened for 1 site(s)" in m for m in messages)
    assert any("completed with 1 update(s), aggregated in" in m for m in messages)
    assert any(f"study {study_id}: train round 2 (attempt 1) opened" in m for m in messages)
