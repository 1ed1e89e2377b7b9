"""Two coordinator instances on one database race to close the same round: exactly one aggregates."""

import threading
from datetime import timedelta
from functools import partial

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from coordinator.config import CoordinatorSettings
from coordinator.db import utc_now
from coordinator.main import create_app
from coordinator.models import AuditEvent, GlobalModel, Round, RoundStatus, Update
from coordinator.rounds.closing import close_round_if_ready, tick
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


def _race(targets: list) -> list:
    barrier = threading.Barrier(len(targets))
    results: list = [None] * len(targets)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = targets[index]()
        except Exception as exc:  # reported by the assertion below
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures, failures
    return results


@pytest.mark.parametrize("entry", ["close_round_if_ready", "tick"])
def test_two_instances_racing_aggregate_each_round_exactly_once(
    client: TestClient, settings: CoordinatorSettings, sessions, entry: str
) -> None:
    study_id, headers = running_study(client, sites=("lyon", "oslo", "graz"), min_sites=2, rounds=3)
    with TestClient(create_app(settings)) as other:
        instances = [client.app.state.coordinator, other.app.state.coordinator]
        for number in (1, 2, 3):
            train_and_upload(client, headers["lyon"], 1.0, 10)
            train_and_upload(other, headers["oslo"], 2.0, 30)  # graz never reports: the deadline closes the round
            with sessions() as session:
                round_id = session.scalar(select(Round.id).where(Round.number == number))
            later = utc_now() + timedelta(seconds=200 * number)  # past this round's deadline
            if entry == "tick":
                calls = [partial(tick, i.sessions, now=later, lease_s=300) for i in instances * 2]
            else:
                calls = [
                    partial(close_round_if_ready, i.sessions, round_id, now=later, lease_s=300) for i in instances * 2
                ]
            results = _race(calls)
            if entry == "close_round_if_ready":
                assert results.count(RoundStatus.COMPLETED) == 1 and results.count(None) == 3
            with sessions() as session:
                models = session.scalar(select(func.count()).where(GlobalModel.round_number == number))
                round_ = session.get(Round, round_id)
                claims = session.scalar(
                    select(func.count()).where(
                        AuditEvent.round_id == round_id, AuditEvent.action == "round.aggregating"
                    )
                )
                completions = session.scalar(
                    select(func.count()).where(AuditEvent.round_id == round_id, AuditEvent.action == "round.completed")
                )
            assert (models, claims, completions) == (1, 1, 1)
            assert round_ is not None and round_.status == RoundStatus.COMPLETED
            with sessions() as session:  # the next round, or after round 3 the final evaluation round
                assert session.scalar(select(func.count()).where(Round.number == number + 1)) == 1
    study = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    assert study["status"] == "running" and study["completed_rounds"] == 3 and study["current_round"] == 4


def test_concurrent_identical_uploads_store_one_update(
    client: TestClient, settings: CoordinatorSettings, sessions
) -> None:
    _, headers = running_study(client, sites=("lyon", "oslo"))
    task = next_task(client, headers["lyon"])
    body = update_body(shifted(download(client, task["global_model_url"], headers["lyon"]), 0.5), 7)
    with TestClient(create_app(settings)) as other:
        responses = _race([partial(upload, c, task, headers["lyon"], body) for c in (client, other, client, other)])
    assert sorted(r.status_code for r in responses) == [200, 200, 200, 201]
    assert len({r.json()["sha256"] for r in responses}) == 1
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Update)) == 1
