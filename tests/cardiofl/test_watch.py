"""Rounds as they settle: the long-poll of GET /studies/{id}/rounds, CardioflClient.watch_rounds and `study watch`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client import cli as client_cli
from cardiofl.client.http import CardioflClient
from site_agent.data import SiteData
from tests.coordinator.factories import ADMIN, create_study, enrol
from tests.site_agent.test_agent import SITES, make_worker, site_data
from tests.site_agent.test_differential_privacy import config, run_service

__all__ = ["site_data"]

SETTLED = {"completed", "failed", "cancelled"}


def rounds_after(coordinator: TestClient, study_id: int, settled: int, wait: float) -> tuple[list[dict], float]:
    start = time.monotonic()
    answer = coordinator.get(f"/api/v1/studies/{study_id}/rounds?settled={settled}&wait={wait}", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    return answer.json()["data"], time.monotonic() - start


def test_watch_yields_every_settled_attempt_once_and_stops_when_the_study_ends(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, _ = run_service(coordinator, site_data, tmp_path, config())
    coordinator.headers.update(ADMIN)  # the agents are done: the researcher's client of the same app
    client = CardioflClient(coordinator)
    every = client.rounds(study_id)
    watched = list(client.watch_rounds(study_id, wait=5))
    assert [r.id for r in watched] == [r.id for r in every if r.status in SETTLED] and len(watched) == 3
    assert [(r.number, r.kind) for r in watched] == [(1, "train"), (2, "train"), (3, "evaluate")]
    _, elapsed = rounds_after(coordinator, study_id, settled=3, wait=20)  # ended: answers at once
    assert elapsed < 5

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
        yield client

    monkeypatch.setattr(client_cli, "connected", in_process)
    lines = CliRunner().invoke(app, ["study", "watch", str(study_id), "--json"]).output.splitlines()
    assert [json.loads(line)["id"] for line in lines] == [r.id for r in watched]  # one RoundPublic a line
    text = CliRunner().invoke(app, ["study", "watch", str(study_id)]).output
    assert "round 1 (train, attempt 1) completed: 2 sites, train loss" in text and f"study {study_id} completed" in text


def test_the_long_poll_waits_for_a_round_to_settle_and_no_longer(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    workers = [
        make_worker(coordinator, name, enrol(coordinator, name), tmp_path / name, b"k" * 32, site_data[name])[0]
        for name in SITES
    ]
    values = config()
    study_id = create_study(coordinator, list(SITES), **{k: v for k, v in values.items() if k != "sites"})
    assert coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    rounds, elapsed = rounds_after(coordinator, study_id, settled=0, wait=1.0)  # nothing settles: the time runs out
    assert elapsed >= 0.9 and not [r for r in rounds if r["status"] in SETTLED]

    def train() -> None:
        time.sleep(0.5)  # the long-poll below is waiting by then
        for worker in workers:
            worker.poll_once()

    thread = threading.Thread(target=train)
    thread.start()
    try:
        rounds, elapsed = rounds_after(coordinator, study_id, settled=0, wait=25.0)
    finally:
        thread.join()
    assert [r["number"] for r in rounds if r["status"] == "completed"] == [1]
    assert elapsed < 20  # answered when round 1 settled, not at the end of the wait
