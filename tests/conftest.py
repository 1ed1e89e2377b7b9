"""Fixtures shared across the suite: a coordinator app on a temporary SQLite database, and its admin."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import create_mock_engine

from coordinator.config import CoordinatorSettings
from coordinator.db import Base, make_engine
from coordinator.main import create_app

ADMIN_TOKEN = "test-admin-token-Xq7Zr2Vn9Lk4Pw8Jb3Hc6Ty1Md"  # 43 base64url characters, 34 distinct


# What `make test-fast` leaves out (`-m "not slow and not postgres and not processes and not browser"`): a test
# file that starts processes (it names subprocess, multiprocessing or a process pool), the folders that run real
# browsers, containers, benchmarks or installed packages, and the end-to-end files below (each still runs in
# `make test`): whole studies through the service and the runner, real agents behind hostile proxies, real ECG
# records, API fuzzing and database upgrades.
PROCESS_WORDS = ("subprocess", "multiprocessing", "ProcessPoolExecutor", "Popen")
FOLDER_MARKS = {"e2e": "browser", "containers": "processes", "bench": "processes", "examples": "processes"}
END_TO_END = {
    "hostile": "real agents behind hostile proxies",
    "cardiofl/test_demo.py": "the demo's coordinator and agents",
    "cardiofl/test_tracking.py": "whole studies tracked to MLflow and TensorBoard",
    "cardiofl/test_model_export.py": "a study run to its exported model",
    "cardiofl/experiment/test_runner.py": "the service against the runner",
    "cardiofl/experiment/test_learned_heads_service.py": "the service against the runner",
    "cardiofl/experiment/test_head_splits_service.py": "the service against the runner",
    "cardiofl/experiment/test_local_baseline.py": "the service against the runner",
    "cardiofl/experiment/test_global_readings.py": "whole runs",
    "cardiofl/experiment/test_plain_resnet_rows.py": "whole runs",
    "cardiofl/experiment/test_auto_heads.py": "whole runs",
    "site_agent/test_secure_rounds.py": "secure studies against the runner",
    "site_agent/test_agent.py": "agents through whole studies",
    "site_agent/test_predict.py": "a study run to its exported model",
    "site_agent/algorithms/test_service.py": "every algorithm through the service",
    "site_agent/data/test_real_data.py": "the real ECG records",
    "coordinator/test_secure_aggregation.py": "secure studies through the service",
    "coordinator/test_schemathesis.py": "the API fuzzed against its OpenAPI document",
    "coordinator/test_upgrade_from_0_4.py": "a database of an old release upgraded",
    "coordinator/test_upgrade_from_release.py": "a database of the previous release upgraded",
    "shared/privacy/test_split_view.py": "the split-view attack over every configuration",
    "coordinator/test_metrics_gauges.py": "whole studies read through /metrics",
}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of files that start processes, of the end-to-end files, and of the slow folders."""
    starts_processes: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in starts_processes:
            starts_processes[path] = any(word in path.read_text(errors="replace") for word in PROCESS_WORDS)
        if starts_processes[path]:
            item.add_marker(pytest.mark.processes)
        relative = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.name
        if relative in END_TO_END or relative.split("/")[0] in END_TO_END:
            item.add_marker(pytest.mark.slow)
        if path.parent.name in FOLDER_MARKS:
            item.add_marker(getattr(pytest.mark, FOLDER_MARKS[path.parent.name]))


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
    if engine.dialect.name == "postgresql":  # the statements create_all sends, in one round trip, not 50
        connection = engine.raw_connection()
        try:
            connection.cursor().execute(_postgres_schema_ddl())
            connection.commit()
        finally:
            connection.close()
    else:
        Base.metadata.create_all(engine)
    engine.dispose()


@functools.cache
def _postgres_schema_ddl() -> str:
    """Every CREATE statement of the models' schema on PostgreSQL, in create_all's order, as one script."""
    statements: list[str] = []
    engine = create_mock_engine(
        "postgresql+psycopg://", lambda sql, *_, **__: statements.append(str(sql.compile(dialect=engine.dialect)))
    )
    Base.metadata.create_all(engine, checkfirst=False)
    return ";\n".join(statements)


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
