"""Reads take no write lock: polls, offers, downloads answer while a writer holds SQLite's; a write in a read fails."""

import sqlite3
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.orm import Session
from sqlalchemy.pool import QueuePool

from coordinator.config import CoordinatorSettings
from coordinator.db import make_engine, reading
from coordinator.main import create_app
from coordinator.models import Site
from tests.conftest import coordinator_settings_for, create_tables
from tests.coordinator.factories import ADMIN, next_task, running_study

HELD_FOR_S = 30.0  # the thread of GETs must have finished long before; the coordinator's busy timeout is 60 s


def test_every_read_a_site_or_admin_makes_answers_while_a_writer_holds_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    create_tables(url)
    monkeypatch.setattr("coordinator.sites.security._LAST_SEEN_RESOLUTION", timedelta(days=1))  # no last_seen write
    settings = coordinator_settings_for(url, blob_dir=str(tmp_path / "blobs"))
    with TestClient(create_app(settings)) as client:
        study_id, headers = running_study(client, sites=("lyon", "oslo"))
        task = next_task(client, headers["lyon"])
        lyon = headers["lyon"]
        reads = [
            ("/api/v1/tasks/next", lyon),
            ("/api/v1/tasks/next?wait=0.2", headers["oslo"]),
            ("/api/v1/sites/me/studies", lyon),
            ("/api/v1/sites/me", lyon),
            (task["global_model_url"], lyon),
            (task["initial_local_url"], lyon),
            ("/api/v1/status", ADMIN),
            ("/api/v1/studies", ADMIN),
            (f"/api/v1/studies/{study_id}", ADMIN),
            (f"/api/v1/studies/{study_id}/rounds", ADMIN),
            (f"/api/v1/studies/{study_id}/rounds?settled=0&wait=0.2", ADMIN),
            (f"/api/v1/studies/{study_id}/audit", ADMIN),
            (f"/api/v1/studies/{study_id}/rounds/1", ADMIN),
            (f"/api/v1/studies/{study_id}/models", ADMIN),
            (f"/api/v1/studies/{study_id}/card?format=html", ADMIN),
            ("/api/v1/sites", ADMIN),
            ("/metrics", ADMIN),
        ]
        answers: dict[str, int] = {}  # in the order they came

        def read_all() -> None:
            for path, caller in reads:
                answers[path] = client.get(path, headers=caller).status_code

        writer = sqlite3.connect(tmp_path / "coordinator.db", isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")  # another process's write transaction, held
        try:
            reader = threading.Thread(target=read_all, daemon=True)
            reader.start()
            reader.join(HELD_FOR_S)
            finished = not reader.is_alive()
            answered = list(answers)
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        reader.join()
    assert finished, f"GET {reads[len(answered)][0]} waited for the write lock (answered before it: {answered})"
    assert answers == {path: 200 for path, _ in reads}


def test_a_write_in_a_reading_transaction_is_refused(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        with Session(reading(engine)) as session, pytest.raises(RuntimeError, match="read-only transaction"):
            session.execute(update(Site).values(name="renamed"))
        with Session(engine) as session:  # a session of the engine itself writes
            session.execute(update(Site).values(name="renamed"))
            session.rollback()
    finally:
        engine.dispose()


def test_a_server_process_opens_at_most_its_max_connections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARDIOFL_DATABASE_MAX_CONNECTIONS", "12")
    settings = CoordinatorSettings(database_url=f"sqlite:///{tmp_path / 'c.db'}", _env_file=None)
    pool = create_app(settings).state.coordinator.engine.pool
    assert isinstance(pool, QueuePool) and (pool.size(), pool._max_overflow) == (10, 2)
    default = make_engine(f"sqlite:///{tmp_path / 'd.db'}").pool
    assert (default.size(), default._max_overflow) == (10, 35)  # more than the 40 request threads
