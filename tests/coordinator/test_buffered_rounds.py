"""Buffered studies through the API: releases at M updates, late updates joining the open buffer, staleness refused."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import update

from coordinator.api.routes import upload_sessions
from coordinator.db import utc_now
from coordinator.models import Round, RoundStatus
from coordinator.rounds.closing import tick
from shared.tensors.codec import TensorDict
from tests.coordinator.factories import (
    ADMIN,
    download,
    next_task,
    running_study,
    shifted,
    train_and_upload,
    update_body,
    upload,
)
from tests.coordinator.job_factories import jobs, validated_study

SITES = ("a", "b", "c")


def _rounds(client: TestClient, study_id: int) -> dict[int, dict[str, Any]]:
    data = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    return {r["number"]: r for r in data}


def _model(client: TestClient, study_id: int, version: int) -> TensorDict:
    return download(client, f"/api/v1/studies/{study_id}/models/{version}", ADMIN)


def _audit(client: TestClient, study_id: int, action: str) -> list[dict[str, Any]]:
    events = client.get(f"/api/v1/studies/{study_id}/audit", headers=ADMIN).json()["data"]
    return [e for e in events if e["action"] == action]


def _release(previous: TensorDict, moves: list[tuple[TensorDict, TensorDict, float]], lr: float = 1.0) -> TensorDict:
    """theta_v + lr * sum u_k (theta_k - base_k), by hand in float64 (integer tensors: the updates' maximum)."""
    out: TensorDict = {}
    for name, value in previous.items():
        if not value.is_floating_point():
            out[name] = torch.stack([theta[name] for theta, _, _ in moves]).amax(dim=0)
            continue
        change = sum(u * (theta[name].double() - base[name].double()) for theta, base, u in moves)
        out[name] = (value.double() + lr * change).to(value.dtype)
    return out


def _close(one: TensorDict, two: TensorDict) -> None:
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=0, atol=1e-6)


def test_a_late_update_joins_the_open_buffer_against_its_own_base(client: TestClient) -> None:
    study_id, headers = running_study(client, SITES, buffered={"buffer_size": 2, "max_staleness": 1}, rounds=5)
    theta_0 = _model(client, study_id, 0)
    late = next_task(client, headers["c"])  # c is tasked in round 1 and comes back after its release
    assert late["round"] == 1 and late["global_model_round"] == 0
    assert train_and_upload(client, headers["a"], 1.0, 10).status_code == 201
    assert _rounds(client, study_id)[1]["status"] == "open"
    assert train_and_upload(client, headers["b"], 2.0, 30).status_code == 201
    assert _rounds(client, study_id)[1]["status"] == "completed"  # M = 2 updates: released
    theta_1 = _model(client, study_id, 1)
    _close(theta_1, _release(theta_0, [(shifted(theta_0, 1.0), theta_0, 0.25), (shifted(theta_0, 2.0), theta_0, 0.75)]))

    body = update_body(shifted(theta_0, 4.0), 20)
    answer = upload(client, late, headers["c"], body)
    assert answer.status_code == 201, answer.text
    assert answer.json()["round"] == 2 and answer.json()["round_id"] != late["round_id"]  # joined buffer 2
    assert upload(client, late, headers["c"], body).json() == answer.json()  # the same bytes: the first receipt
    assert upload(client, late, headers["c"], update_body(shifted(theta_0, 5.0), 20)).status_code == 409
    assert client.get("/api/v1/tasks/next", headers=headers["c"]).status_code == 204

    fresh = next_task(client, headers["a"])
    assert fresh["round"] == 2 and fresh["global_model_round"] == 1
    assert upload(client, fresh, headers["a"], update_body(shifted(theta_1, 1.0), 20)).status_code == 201
    theta_2 = _model(client, study_id, 2)
    u_a, u_c = 0.5, 0.5 / math.sqrt(2)  # equal n: w = 1/2 each; c lags one version: s(1) = 1/sqrt(2)
    _close(theta_2, _release(theta_1, [(shifted(theta_1, 1.0), theta_1, u_a), (shifted(theta_0, 4.0), theta_0, u_c)]))

    metrics = client.get("/metrics", headers=ADMIN).text
    assert 'cardiofl_update_staleness_count{site="c"} 1.0' in metrics  # c: one update, 1 version behind
    assert 'cardiofl_update_staleness_sum{site="c"} 1.0' in metrics
    assert 'cardiofl_update_staleness_count{site="a"} 2.0' in metrics and 'staleness_sum{site="a"} 0.0' in metrics
    released = _rounds(client, study_id)[2]
    assert {u["site"]: u["weight"] for u in released["updates"]} == {"a": u_a, "c": u_c}
    assert {u["site"]: (u["base_round"], u["staleness"]) for u in released["updates"]} == {"a": (1, 0), "c": (0, 1)}
    completed = [e for e in _audit(client, study_id, "round.completed") if e["detail"]["round"] == 2]
    assert completed[0]["detail"]["bases"] == {"a": 1, "c": 0}
    accepted = [e for e in _audit(client, study_id, "update.accepted") if e["detail"]["base_round"] is not None]
    routed = [(e["detail"]["base_round"], e["round_id"]) for e in accepted if e["round_id"] != late["round_id"]]
    assert (0, answer.json()["round_id"]) in routed  # c's, tasked in round 1, stored in buffer 2
    assert all(e["detail"]["task_round_id"] for e in accepted)


def test_an_update_too_many_versions_behind_is_refused_with_the_reason(client: TestClient) -> None:
    study_id, headers = running_study(client, SITES, buffered={"buffer_size": 2, "max_staleness": 1}, rounds=5)
    held = next_task(client, headers["c"])  # round 1, from theta^g_0
    for _ in range(2):  # two releases by a and b: the open buffer's base is version 2
        assert train_and_upload(client, headers["a"], 1.0, 10).status_code == 201
        assert train_and_upload(client, headers["b"], 1.0, 10).status_code == 201
    theta_0 = _model(client, study_id, 0)
    answer = upload(client, held, headers["c"], update_body(shifted(theta_0, 1.0), 10))
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "update_too_stale", answer.text
    assert "2 versions behind" in answer.json()["error"]["message"] and "max_staleness" in answer.text
    refused = _audit(client, study_id, "update.refused")
    assert refused and refused[-1]["detail"]["code"] == "update_too_stale"
    task = next_task(client, headers["c"])  # it trains again from the latest version
    assert task["round"] == 3 and task["global_model_round"] == 2


def test_an_update_arriving_during_a_release_waits_instead_of_being_lost(client: TestClient) -> None:
    study_id, headers = running_study(client, SITES, buffered={"buffer_size": 2}, rounds=3)
    held = next_task(client, headers["c"])
    assert train_and_upload(client, headers["a"], 1.0, 10).status_code == 201
    assert train_and_upload(client, headers["b"], 1.0, 10).status_code == 201  # buffer 1 released, 2 open
    state = client.app.state.coordinator
    with state.sessions() as session:  # as if buffer 2 were being released now, with no buffer open
        session.execute(update(Round).where(Round.number == 2).values(status=RoundStatus.AGGREGATING))
        session.commit()
    body = update_body(shifted(_model(client, study_id, 0), 1.0), 10)
    answer = upload(client, held, headers["c"], body)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "buffer_releasing", answer.text
    assert answer.headers["Retry-After"]
    with state.sessions() as session:
        session.execute(update(Round).where(Round.number == 2).values(status=RoundStatus.OPEN))
        session.commit()
    assert upload(client, held, headers["c"], body).status_code == 201  # sent again: it joins buffer 2


def test_after_the_last_release_a_late_update_is_refused_as_the_round_closed(client: TestClient) -> None:
    study_id, headers = running_study(client, SITES, buffered={"buffer_size": 2}, rounds=1)
    held = next_task(client, headers["c"])
    assert train_and_upload(client, headers["a"], 1.0, 10).status_code == 201
    assert train_and_upload(client, headers["b"], 1.0, 10).status_code == 201  # the last release: evaluation opens
    answer = upload(client, held, headers["c"], update_body(shifted(_model(client, study_id, 0), 1.0), 10))
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "round_closed", answer.text


def test_a_buffer_short_of_m_releases_at_its_deadline_with_min_sites(client: TestClient) -> None:
    study_id, headers = running_study(client, SITES, buffered={"buffer_size": 3}, min_sites=1, round_deadline_s=60.0)
    assert train_and_upload(client, headers["a"], 1.0, 10).status_code == 201
    assert _rounds(client, study_id)[1]["status"] == "open"
    state = client.app.state.coordinator
    tick(state.sessions, now=utc_now() + timedelta(seconds=61), lease_s=state.settings.aggregation_lease_s)
    assert _rounds(client, study_id)[1]["status"] == "completed"
    assert [u["site"] for u in _rounds(client, study_id)[1]["updates"]] == ["a"]


def test_a_validation_site_validates_every_nth_version_and_the_last(client: TestClient) -> None:
    study_id, headers = validated_study(
        client, ("a", "b"), ("graz",), buffered={"buffer_size": 1}, rounds=3, validation_every=2
    )
    held = next_task(client, headers["b"])  # b answers version 1's task after two releases by a
    for _ in range(2):
        assert train_and_upload(client, headers["a"], 1.0, 10).status_code == 201
    assert [job["round"] for job in jobs(client, headers["graz"])] == [2]  # every 2nd version
    assert (
        upload(client, held, headers["b"], update_body(shifted(_model(client, study_id, 0), 1.0), 10)).json()["round"]
        == 3
    )  # the last release, from b's late update alone (M = 1)
    assert [job["round"] for job in jobs(client, headers["graz"])] == [2, 3]  # and the final one
    assert "graz" not in _rounds(client, study_id)[3]["participants"]


def test_a_full_buffer_takes_no_more_updates_until_the_next_opens(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, headers = running_study(client, SITES, buffered={"buffer_size": 2}, rounds=2)
    monkeypatch.setattr(upload_sessions, "close_round_if_ready", lambda *args, **kwargs: None)  # no release yet
    tasks = {site: next_task(client, headers[site]) for site in SITES}
    theta_0 = _model(client, study_id, 0)
    for site in ("a", "b"):
        assert upload(client, tasks[site], headers[site], update_body(shifted(theta_0, 1.0), 10)).status_code == 201
    third = upload(client, tasks["c"], headers["c"], update_body(shifted(theta_0, 2.0), 10))
    assert third.status_code == 503 and third.json()["error"]["code"] == "buffer_releasing", third.text
    assert len(_rounds(client, study_id)[1]["updates"]) == 2  # exactly M
