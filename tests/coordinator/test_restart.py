"""A coordinator killed at any point and restarted on the same database continues without loss or double counting."""

from datetime import timedelta

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from coordinator.config import CoordinatorSettings
from coordinator.db import utc_now
from coordinator.main import create_app
from coordinator.models import AuditEvent, GlobalModel, Round, RoundStatus, Update
from coordinator.rounds.closing import aggregate_round, tick
from tests.coordinator.factories import (
    ADMIN,
    download,
    evaluate_and_upload,
    expected_average,
    next_task,
    running_study,
    shifted,
    train_and_upload,
    update_body,
    upload,
)


class Killed(BaseException):
    """The process died here (nothing after this line ran)."""


def _die(*_args: object, **_kwargs: object) -> None:
    raise Killed


def _doomed_instance(settings: CoordinatorSettings) -> TestClient:
    """An instance that is about to be killed: no lifespan to shut down, its engine dropped by `_kill`."""
    return TestClient(create_app(settings))


def _kill(instance: TestClient) -> None:
    instance.app.state.coordinator.engine.dispose()


def _assert_round_one_is_the_average_of(client: TestClient, study_id: int, weighted: list[tuple[float, float]]) -> None:
    base = download(client, f"/api/v1/studies/{study_id}/models/0", ADMIN)
    actual = download(client, f"/api/v1/studies/{study_id}/models/1", ADMIN)
    expected = expected_average([(shifted(base, delta), weight) for delta, weight in weighted])
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-6)


def test_killed_while_aggregating_a_restarted_instance_takes_over(
    settings: CoordinatorSettings, sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _doomed_instance(settings)
    study_id, headers = running_study(client, sites=("lyon", "oslo", "graz"), min_sites=2)
    train_and_upload(client, headers["lyon"], 1.0, 10)
    train_and_upload(client, headers["oslo"], 3.0, 30)
    round_id = next_task(client, headers["graz"])["round_id"]
    state = client.app.state.coordinator
    with monkeypatch.context() as patch:
        patch.setattr("coordinator.rounds.closing._finish", _die)
        with pytest.raises(Killed):
            aggregate_round(state.sessions, round_id, now=utc_now() + timedelta(seconds=61), lease_s=300)
    _kill(client)  # the first instance is gone; its lease is left behind

    with TestClient(create_app(settings)) as restarted:
        sessions_after = restarted.app.state.coordinator.sessions
        tick(sessions_after, now=utc_now() + timedelta(seconds=120), lease_s=300)  # lease still valid: wait
        with sessions() as session:
            assert session.get(Round, round_id).status == RoundStatus.AGGREGATING
        tick(sessions_after, now=utc_now() + timedelta(seconds=400), lease_s=300)
        with sessions() as session:
            assert session.get(Round, round_id).status == RoundStatus.COMPLETED
            actions = session.scalars(select(AuditEvent.action).where(AuditEvent.round_id == round_id)).all()
            assert actions.count("round.completed") == 1 and "round.aggregation_taken_over" in actions
            assert session.scalar(select(func.count()).where(GlobalModel.round_number == 1)) == 1
        _assert_round_one_is_the_average_of(restarted, study_id, [(1.0, 0.25), (3.0, 0.75)])
        assert next_task(restarted, headers["graz"])["round"] == 2


def test_killed_after_the_last_update_a_restarted_instance_aggregates(
    settings: CoordinatorSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _doomed_instance(settings)
    study_id, headers = running_study(client)
    train_and_upload(client, headers["lyon"], 1.0, 10)
    with monkeypatch.context() as patch:  # dies right after committing the update, before closing the round
        patch.setattr("coordinator.api.routes.upload_sessions.close_round_if_ready", _die)
        with pytest.raises(Killed):
            train_and_upload(client, headers["oslo"], 2.0, 10)
    _kill(client)

    with TestClient(create_app(settings)) as restarted:
        assert restarted.get(f"/api/v1/studies/{study_id}/rounds/1", headers=ADMIN).json()["status"] == "open"
        state = restarted.app.state.coordinator
        tick(state.sessions, now=utc_now(), lease_s=300)  # every participant reported: no need to wait
        round_ = restarted.get(f"/api/v1/studies/{study_id}/rounds/1", headers=ADMIN).json()
        assert round_["status"] == "completed" and len(round_["updates"]) == 2
        _assert_round_one_is_the_average_of(restarted, study_id, [(1.0, 0.5), (2.0, 0.5)])


def test_killed_while_storing_an_update_nothing_is_half_stored(
    settings: CoordinatorSettings, sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _doomed_instance(settings)
    study_id, headers = running_study(client)
    task = next_task(client, headers["lyon"])
    body = update_body(shifted(download(client, task["global_model_url"], headers["lyon"]), 1.0), 10)
    with monkeypatch.context() as patch:
        patch.setattr("coordinator.rounds.updates.audit.record", _die)  # after the blob and the row, before commit
        with pytest.raises(Killed):
            upload(client, task, headers["lyon"], body)
    _kill(client)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Update)) == 0

    with TestClient(create_app(settings)) as restarted:
        assert upload(restarted, task, headers["lyon"], body).status_code == 201  # the agent's retry
        assert upload(restarted, task, headers["lyon"], body).status_code == 200
        assert train_and_upload(restarted, headers["oslo"], 3.0, 10).status_code == 201
        _assert_round_one_is_the_average_of(restarted, study_id, [(1.0, 0.5), (3.0, 0.5)])


def test_a_study_runs_to_completion_across_restarts(settings: CoordinatorSettings) -> None:
    client = _doomed_instance(settings)
    study_id, headers = running_study(client, rounds=3)
    for site in ("lyon", "oslo"):
        train_and_upload(client, headers[site], 0.5, 8)
    _kill(client)
    for _ in range(2):
        with TestClient(create_app(settings)) as restarted:
            for site in ("lyon", "oslo"):
                assert train_and_upload(restarted, headers[site], 0.5, 8).status_code == 201
    with TestClient(create_app(settings)) as final:
        for site in ("lyon", "oslo"):
            assert evaluate_and_upload(final, headers[site]).status_code == 201
        study = final.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
        assert study["status"] == "completed" and study["completed_rounds"] == 3
        rounds = final.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
        assert [(r["number"], len(r["updates"])) for r in rounds] == [(1, 2), (2, 2), (3, 2), (4, 2)]
