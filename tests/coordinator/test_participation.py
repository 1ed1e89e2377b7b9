"""Centre dropout in the service: the round engine hands each site's measured round time to the policy."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import utc_now
from coordinator.rounds.opening import last_round_seconds
from tests.coordinator.factories import ADMIN, running_study, train_and_upload

SITES = ("a", "b", "c", "d")


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Seconds since the test began, as uploads see the time: set clock[0] to move it."""
    start, seconds = utc_now(), [0.0]
    monkeypatch.setattr("coordinator.api.routes.upload_sessions.utc_now", lambda: start + timedelta(seconds=seconds[0]))
    return seconds


def test_fast_on_odd_drops_the_slowest_sites_of_the_last_round(
    client: TestClient, sessions: sessionmaker[Session], clock: list[float]
) -> None:
    study_id, headers = running_study(
        client, SITES, participation={"name": "fast_on_odd", "params": {"f": 0.5}}, round_deadline_s=3600.0, rounds=3
    )

    for site in SITES:  # round 1 (odd): nobody measured yet, so everybody trains
        assert train_and_upload(client, headers[site], 0.1, 10).status_code == 201
    rounds = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert rounds[0]["participants"] == dict.fromkeys(SITES, 1.0)
    for site, seconds in (("a", 10.0), ("c", 20.0), ("d", 30.0), ("b", 40.0)):  # round 2 opened at 0 s
        clock[0] = seconds
        assert train_and_upload(client, headers[site], 0.1, 10).status_code == 201

    with sessions() as session:
        assert last_round_seconds(session, study_id) == {"a": 10.0, "b": 40.0, "c": 20.0, "d": 30.0}
    rounds = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert rounds[1]["participants"] == dict.fromkeys(SITES, 1.0)  # even round: everyone
    assert rounds[2]["participants"] == {"a": 2.0, "c": 2.0}  # the slowest half sits out, the rest trains twice


def test_round_times_are_per_unit_of_load(
    client: TestClient, sessions: sessionmaker[Session], clock: list[float]
) -> None:
    study_id, headers = running_study(
        client, ("a", "b"), participation={"name": "fewer_on_odd", "params": {"f": 0.5}}, round_deadline_s=3600.0
    )
    rounds = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    (site,) = rounds[0]["participants"]  # round 1 (odd): one site, load factor 2
    assert rounds[0]["participants"][site] == 2.0
    clock[0] = 0.0
    assert train_and_upload(client, headers[site], 0.1, 10).status_code == 201
    clock[0] = 12.0  # round 2 opened at 0 s, both sites at load 1
    for name in ("a", "b"):
        assert train_and_upload(client, headers[name], 0.1, 10).status_code == 201
        clock[0] += 6.0
    with sessions() as session:
        times = last_round_seconds(session, study_id)
    assert times == {"a": 12.0, "b": 18.0}
