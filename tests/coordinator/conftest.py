"""Coordinator fixtures: every database test runs on SQLite, and on PostgreSQL when it is reachable.

PostgreSQL tests each get a fresh schema, so concurrent runs never see each other's rows. With
CI=true an unreachable PostgreSQL fails those tests instead of skipping them.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from coordinator.config import CoordinatorSettings
from coordinator.db import make_engine, make_sessionmaker
from coordinator.main import create_app
from coordinator.storage.update_files import FileBlobStore
from tests.conftest import coordinator_settings_for, create_tables

POSTGRES_URL = os.environ.get("CARDIOFL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never depend on CARDIOFL_* settings of the developer's shell."""
    for name in list(os.environ):
        if name.startswith("CARDIOFL_") and not name.startswith("CARDIOFL_TEST_"):
            monkeypatch.delenv(name)


@cache
def _postgres_problem() -> str | None:
    engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:  # any failure to connect means: not reachable
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        engine.dispose()
    return None


def postgres_schema_url() -> Iterator[str]:
    """A URL whose connections use a fresh schema of their own; the schema is dropped afterwards."""
    problem = _postgres_problem()
    if problem is not None:
        message = f"PostgreSQL at {POSTGRES_URL} is unreachable ({problem})"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI must run the PostgreSQL tests")
        pytest.skip(message)
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    separator = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{separator}options=-csearch_path%3D{schema}"
    finally:
        _drop_schema(admin, schema)
        admin.dispose()


def _drop_schema(admin: Engine, schema: str, attempts: int = 5) -> None:
    """Drop a test's schema; a connection of the app that is still finishing (a ticker's last pass) may hold a lock.

    PostgreSQL then picks the DROP as a deadlock's victim and rolls it back: it is tried again shortly after.
    """
    for attempt in range(attempts):
        try:
            with admin.begin() as connection:
                connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            return
        except OperationalError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'coordinator.db'}"
    else:
        yield from postgres_schema_url()


@pytest.fixture()
def database_url(empty_database_url: str) -> str:
    """A database with the models' tables."""
    create_tables(empty_database_url)
    return empty_database_url


@pytest.fixture()
def blob_dir(tmp_path: Path) -> Path:
    """The test coordinator's blob store, on either database."""
    return tmp_path / "blobs"


@pytest.fixture()
def settings(database_url: str, blob_dir: Path) -> CoordinatorSettings:
    """Test settings on the parametrised database, with updates in a blob store."""
    return coordinator_settings_for(database_url, blob_dir=str(blob_dir))


@pytest.fixture()
def client(settings: CoordinatorSettings) -> Iterator[TestClient]:
    """The coordinator app on the parametrised database."""
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture()
def sessions(database_url: str, blob_dir: Path) -> Iterator[sessionmaker[Session]]:
    """Sessions on the test database and blob store, for looking behind the API."""
    engine = make_engine(database_url)
    yield make_sessionmaker(engine, FileBlobStore(blob_dir))
    engine.dispose()


def wait_serving(
    health: Callable[[], httpx.Response], server: subprocess.Popen, output: Callable[[], str], seconds: float = 90
) -> None:
    """Until `health()` answers 200: the server process must stay up (else its `output()`), for `seconds` at most."""
    give_up = time.monotonic() + seconds
    while True:
        assert server.poll() is None, output()
        try:
            if health().status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < give_up, "coordinator did not come up"
        time.sleep(0.2)
