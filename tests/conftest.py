"""Fixtures shared across the suite: a coordinator app on a temporary SQLite database, and its admin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.config import CoordinatorSettings
from coordinator.db import Base, make_engine
from coordinator.main import create_app

ADMIN_TOKEN = "test-admin-token"


def coordinator_settings_for(database_url: str, **overrides: object) -> CoordinatorSettings:
    """Settings for a test coordinator: no .env, bootstrap admin, no background ticker, quick polls."""
    values: dict[str, object] = {
        "database_url": database_url,
        "admin_token": ADMIN_TOKEN,
        "migrate_on_start": False,
        "tick_interval_s": 0,
        "task_poll_interval_s": 0.02,
        **overrides,
    }
    return CoordinatorSettings(_env_file=None, **values)  # type: ignore[arg-type]


def create_tables(database_url: str) -> None:
    """The models' schema on an empty database (migrations are tested on their own)."""
    engine = make_engine(database_url)
    Base.metadata.create_all(engine)
    engine.dispose()


@pytest.fixture()
def coordinator_settings(tmp_path: Path) -> CoordinatorSettings:
    """A fresh SQLite coordinator database."""
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    create_tables(url)
    return coordinator_settings_for(url)


@pytest.fixture()
def coordinator(coordinator_settings: CoordinatorSettings) -> Iterator[TestClient]:
    """The running coordinator app (lifespan included) behind a TestClient, which is an httpx.Client."""
    with TestClient(create_app(coordinator_settings)) as client:
        yield client


@pytest.fixture()
def admin_headers() -> dict[str, str]:
    """Authorization of the bootstrap admin."""
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}
