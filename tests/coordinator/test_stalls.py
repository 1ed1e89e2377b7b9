"""No participant can stall a study: absurd metrics are refused, and a failing aggregation fails its round."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError, StatementError
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import utc_now
from coordinator.models import AuditEvent, Round, RoundStatus, Study, StudyStatus
from coordinator.rounds import closing, plain
from shared.evaluation.summaries import pooled_summaries
from shared.wire.protocol import MAX_METRIC, UPDATE_META_KEY
from tests.coordinator.factories import ADMIN, download, next_task, running_study, shifted, upload
from tests.coordinator.factories import train_and_upload as train


def _body(base: dict, metrics: dict[str, Any]) -> bytes:
    """An upload whose UpdateMeta JSON carries `metrics` as given (bypassing the agent's own validation)."""
    from shared.tensors.codec import dump

    meta = {"num_examples": 10, "metrics": metrics, "train_seconds": 1.0}
    return dump(shifted(base, 1.0), {UPDATE_META_KEY: json.dumps(meta)})


@pytest.mark.parametrize(
    ("metrics", "named"),
    [
        ({"loss": 1e308}, "loss"),
        ({"loss": -0.5}, "loss"),
        ({"loss": 0.5, "samples_per_second": float("inf")}, "metrics.samples_per_second is inf"),
        ({"loss": 0.5, "entropy": float("nan")}, "metrics.entropy is nan"),
        ({"loss": 0.5, "extra": {"deep": [1.0, 2.0, 1e300]}}, "metrics.extra.deep[2] is 1e+300"),
        ({"loss": 0.5, "eval_stats": {"n_classes": 20, "tp": [1e200] * 20}}, "metrics.eval_stats.tp[0]"),
    ],
)
def test_absurd_or_non_finite_metrics_are_refused_at_upload(
    client: TestClient, metrics: dict[str, Any], named: str
) -> None:
    _, headers = running_study(client, sites=("lyon",))
    task = next_task(client, headers["lyon"])
    base = download(client, task["global_model_url"], headers["lyon"])
    sane = upload(client, task, headers["lyon"], _body(base, {"loss": 0.5, "entropy": 0.1}))
    assert sane.status_code == 201, sane.text  # the same body with sane numbers is accepted
    _, headers = running_study(client, sites=("oslo",))
    task = next_task(client, headers["oslo"])
    response = upload(client, task, headers["oslo"], _body(base, metrics))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_update_meta" and named in error["message"]


def test_the_pooled_loss_does_not_overflow_where_the_sum_of_n_k_times_loss_would() -> None:
    # rows stored before uploads were bounded: 40 * 1e308 overflows, the mean of fractions does not
    pooled = pooled_summaries([(10, {"loss": 1e308}), (30, {"loss": 1e308})], 20)
    assert pooled["train_loss"] == pytest.approx(1e308)
    assert pooled_summaries([(10, {"loss": 0.5})], 20, trained=False)["train_loss"] is None
    assert MAX_METRIC * 100_000_000 * 10_000 < 1e308  # within the bounds the sum could not overflow either


def test_nothing_non_finite_is_written_as_json(sessions: sessionmaker[Session], client: TestClient) -> None:
    study_id, _ = running_study(client, sites=("lyon",))
    with sessions() as session:
        round_ = session.scalar(select(Round).where(Round.study_id == study_id))
        assert round_ is not None
        round_.pooled = {"note": float("inf")}
        with pytest.raises((StatementError, ValueError), match="not JSON compliant"):
            session.commit()


def _rounds_of(sessions: sessionmaker[Session], study_id: int) -> list[Round]:
    with sessions() as session:
        return list(session.scalars(select(Round).where(Round.study_id == study_id).order_by(Round.id)))


def test_an_aggregation_that_fails_for_good_fails_its_round_once_and_the_round_is_retried(
    client: TestClient, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, headers = running_study(client, sites=("lyon",), round_retries=1)

    def refused(*_args: Any, **_kwargs: Any) -> bool:
        raise ValueError("the database refused the round's JSON")

    monkeypatch.setattr(closing, "_finish", refused)
    assert train(client, headers["lyon"], 1.0, 10).status_code == 201
    first, retry = _rounds_of(sessions, study_id)
    assert first.status == RoundStatus.FAILED and "ValueError: the database refused" in first.note
    assert retry.status == RoundStatus.OPEN and retry.attempt == 2
    # the ticker does not take it up again once its lease would have run out: the failed round is settled
    closing.tick(client.app.state.coordinator.sessions, now=utc_now() + timedelta(seconds=31), lease_s=30)
    assert _rounds_of(sessions, study_id)[0].status == RoundStatus.FAILED
    with sessions() as session:
        failures = session.scalars(select(AuditEvent).where(AuditEvent.action == "round.failed")).all()
        assert [event.round_id for event in failures] == [first.id]
        study = session.get(Study, study_id)
        assert study is not None and study.status == StudyStatus.RUNNING
    monkeypatch.undo()
    assert train(client, headers["lyon"], 1.0, 10).status_code == 201  # the retry completes
    assert _rounds_of(sessions, study_id)[1].status == RoundStatus.COMPLETED


def test_a_lost_connection_leaves_the_round_to_a_takeover(
    client: TestClient, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, headers = running_study(client, sites=("lyon",))

    def disconnected(*_args: Any, **_kwargs: Any) -> bool:
        raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(closing, "_finish", disconnected)
    task = next_task(client, headers["lyon"])
    base = download(client, task["global_model_url"], headers["lyon"])
    from tests.coordinator.factories import update_body

    with pytest.raises(OperationalError):  # the background close surfaces it through the test client
        upload(client, task, headers["lyon"], update_body(shifted(base, 1.0), 10))
    (round_,) = _rounds_of(sessions, study_id)
    assert round_.status == RoundStatus.AGGREGATING  # not failed: another worker takes it over
    monkeypatch.undo()
    state = client.app.state.coordinator
    closing.tick(state.sessions, now=utc_now() + timedelta(seconds=31), lease_s=30)
    assert _rounds_of(sessions, study_id)[0].status == RoundStatus.COMPLETED


def test_a_slow_aggregation_renews_its_lease_and_is_never_taken_over(
    client: TestClient, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, headers = running_study(client, sites=("lyon",))
    state = client.app.state.coordinator
    real_add = plain.add_stored_updates
    started = threading.Event()

    def slow_add(*args: Any, **kwargs: Any) -> None:
        started.set()
        time.sleep(1.5)  # five lease lengths
        real_add(*args, **kwargs)

    monkeypatch.setattr(plain, "add_stored_updates", slow_add)
    lease_s = 0.3
    task = next_task(client, headers["lyon"])
    base = download(client, task["global_model_url"], headers["lyon"])
    from tests.coordinator.factories import update_body

    with state.sessions() as session:  # store the update without closing the round
        from coordinator.rounds.updates import accept_update
        from coordinator.sites.security import Principal

        site_id = session.execute(text("SELECT id FROM sites WHERE name = 'lyon'")).scalar()
        accept_update(
            session,
            round_id=task["round_id"],
            site=Principal("site", "site:lyon", site_id=site_id, site_name="lyon"),
            body=update_body(shifted(base, 1.0), 10),
            max_num_examples=10**6,
            now=utc_now(),
        )
    results: list[bool] = []
    worker = threading.Thread(
        target=lambda: results.append(
            closing.aggregate_round(state.sessions, task["round_id"], now=utc_now(), lease_s=lease_s)
        )
    )
    worker.start()
    assert started.wait(10)
    takeovers = []
    while worker.is_alive():
        takeovers.append(closing.aggregate_round(state.sessions, task["round_id"], now=utc_now(), lease_s=lease_s))
        time.sleep(0.1)
    worker.join()
    assert results == [True] and not any(takeovers) and len(takeovers) >= 5
    with sessions() as session:
        actions = session.scalars(select(AuditEvent.action).where(AuditEvent.round_id == task["round_id"])).all()
    assert "round.aggregation_taken_over" not in actions and "round.completed" in actions
    assert client.get(f"/api/v1/studies/{study_id}/rounds/1", headers=ADMIN).json()["status"] == "completed"
