"""The hostile suite's fixtures: the coordinator on SQLite and PostgreSQL (tests/coordinator/conftest.py), 4 sites."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from site_agent.data import SiteData
from tests.coordinator.conftest import _clean_environ, blob_dir, client, database_url, empty_database_url, settings
from tests.hostile.harness import SITES, Federation, federation_of, synthetic_hospitals

__all__ = ["_clean_environ", "blob_dir", "client", "database_url", "empty_database_url", "settings"]


@pytest.fixture(scope="session")
def site_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteData]:
    """Four small synthetic hospitals (about 25 training and 8 test records each), written once per test process."""
    return synthetic_hospitals(tmp_path_factory.mktemp("hostile-ecg"), SITES, seed=3)


@pytest.fixture()
def federation(client: TestClient, site_data: dict[str, SiteData], tmp_path: Path) -> Federation:
    """The coordinator (on the parametrised database) and the four sites' agents, enrolled."""
    return federation_of(client, site_data, tmp_path)
