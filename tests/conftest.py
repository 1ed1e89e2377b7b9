"""Fixtures shared across the suite: a coordinator app on a temporary SQLite database, and its admin."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from coordinator.config import CoordinatorSettings
from coordinator.db import Base, make_engine
from coordinator.main import create_app

ADMIN_TOKEN = "test-admin-token-Xq7Zr2Vn9Lk4Pw8Jb3Hc6Ty1Md"  # 43 base64url characters, 34 distinct


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch takes its share of the cores, so workers do not oversubscribe them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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
