"""`cardiofl site check`: one report of the site's readiness, each check ok, warning or failed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from shared.labels import CLASS_NAMES
from shared.wire.protocol import PROTOCOL_VERSION
from site_agent import preflight
from site_agent.config import AgentSettings
from site_agent.store import SiteStore, load_key, write_key_file
from tests.conftest import ADMIN_TOKEN
from tests.site_agent.data.records import make_record
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals"]  # the autouse fixture: no CARDIOFL_* variable leaks in

runner = CliRunner()
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def enrolled(coordinator: TestClient, name: str) -> str:
    """Enroll site `name` at the coordinator; its token."""
    response = coordinator.post("/api/v1/sites", json={"name": name}, headers=ADMIN)
    assert response.is_success, response.text
    return str(response.json()["token"]["token"])


def via(coordinator: TestClient) -> Callable[[AgentSettings], httpx.Client]:
    """Connect the check to the in-process coordinator, with the token of the site's config."""

    def connect(settings: AgentSettings) -> httpx.Client:
        token = (settings.token_file.read_text() if settings.token_file else "").strip()
        return httpx.Client(
            transport=coordinator._transport,
            base_url=str(coordinator.base_url),
            headers={"Authorization": f"Bearer {token}"},
        )

    return connect


@pytest.fixture()
def site(tmp_path: Path, coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site 'lyon' enrolled at the in-process coordinator, with its token, over (nominal) HTTPS; its config."""
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    (tmp_path / "token").write_text(enrolled(coordinator, "lyon") + "\n")
    monkeypatch.setenv("CARDIOFL_SITE_COORDINATOR_URL", "https://coordinator.example.org")
    monkeypatch.setattr(preflight, "connect", via(coordinator))
    return config


def check(config: Path) -> tuple[int, dict[str, Any]]:
    """Run `cardiofl site check --json` with the tiny preset; its exit code and checks by name."""
    result = runner.invoke(app, ["site", "check", "--config", str(config), "--preset", "tiny", "--json"])
    report = json.loads(result.stdout)
    assert report["ready"] is (result.exit_code == 0), result.output
    return result.exit_code, {c["name"]: c for c in report["checks"]}


def test_a_ready_site_passes_every_check(site: Path) -> None:
    code, checks = check(site)
    assert code == 0
    assert list(checks) == ["settings", "store", "tls", "data", "coordinator", "device"]
    assert {name: c["status"] for name, c in checks.items()} == dict.fromkeys(checks, "ok")
    assert checks["data"]["loaded"] == 3 and checks["data"]["labels"] == {"AFIB": 3}
    assert checks["data"]["sources"][0]["label_counts"][CLASS_NAMES.index("AFIB")] == 3
    assert checks["data"]["sources"][0]["sampling_rates"] == {"500 Hz": 3}
    assert "token is site 'lyon'" in checks["coordinator"]["detail"]


def test_the_data_check_reports_the_sampling_rates_seen(site: Path) -> None:
    folder = site.parent / "wfdb"  # the challenge source of the fixture
    for name, fs in (("hz400", 400), ("hz1000", 1000), ("hz1000b", 1000)):
        make_record(folder, name, seed=fs, fs=fs, n_samples=fs * 2)
    code, checks = check(site)
    assert code == 0
    assert checks["data"]["sources"][0]["sampling_rates"] == {"500 Hz": 3, "400 Hz": 1, "1000 Hz": 2}
    assert "data.0 sampling rates: 400 Hz 1, 500 Hz 3, 1000 Hz 2" in checks["data"]["lines"]


def test_the_table_says_ready(site: Path) -> None:
    result = runner.invoke(app, ["site", "check", "--config", str(site), "--preset", "tiny"])
    assert result.exit_code == 0, result.output
    assert "coordinator" in result.output and "data.0 labels: AFIB=3" in result.output
    assert result.output.rstrip().endswith("site ready")


def test_a_wrong_store_key_fails_the_store_and_the_rest_is_still_reported(site: Path) -> None:
    key_file = site.parent / "store.key"
    SiteStore(site.parent / "store", load_key(env_value=None, key_file=key_file), "lyon")
    key_file.unlink()
    write_key_file(key_file)  # another key
    code, checks = check(site)
    assert code == 1
    assert checks["store"]["status"] == "failed" and "key" in checks["store"]["detail"]
    assert "\n" not in checks["store"]["detail"]
    assert {checks[n]["status"] for n in ("settings", "tls", "data", "coordinator", "device")} == {"ok"}


def test_a_missing_data_folder_fails_the_data_check_naming_its_setting(site: Path) -> None:
    text = site.read_text().replace(str(site.parent / "wfdb"), str(site.parent / "nowhere"))
    site.write_text(text)
    code, checks = check(site)
    assert code == 1
    assert checks["data"]["status"] == "failed" and "data.0.path" in checks["data"]["detail"]
    assert checks["coordinator"]["status"] == "ok" and checks["device"]["status"] == "ok"


def test_an_unreachable_coordinator_fails_with_one_line(tmp_path: Path) -> None:
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])  # http://127.0.0.1:9: refused
    code, checks = check(config)
    assert code == 1
    detail = checks["coordinator"]["detail"]
    assert checks["coordinator"]["status"] == "failed" and detail.startswith("unreachable: ") and "\n" not in detail
    assert checks["tls"]["status"] == "warning" and "plain HTTP" in checks["tls"]["detail"]
    assert checks["data"]["status"] == "ok"


def test_another_sites_token_fails_naming_the_name_setting(site: Path, coordinator: TestClient) -> None:
    (site.parent / "token").write_text(enrolled(coordinator, "bern"))
    code, checks = check(site)
    assert code == 1
    detail = checks["coordinator"]["detail"]
    assert checks["coordinator"]["status"] == "failed" and "setting 'name'" in detail and "'bern'" in detail


def test_a_revoked_or_wrong_token_fails_naming_the_token_setting(site: Path) -> None:
    (site.parent / "token").write_text("not-a-token")
    code, checks = check(site)
    assert code == 1 and "setting 'token'" in checks["coordinator"]["detail"]


def test_a_coordinator_that_no_longer_serves_this_agent_fails_saying_what_to_upgrade(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.api import deps

    monkeypatch.setattr(deps, "MIN_PROTOCOL_VERSION", PROTOCOL_VERSION + 1)  # the coordinator moved on
    code, checks = check(site)
    assert code == 1 and checks["coordinator"]["status"] == "failed"
    assert "upgrade the site agent" in checks["coordinator"]["detail"]


def test_settings_that_do_not_load_skip_the_checks_that_need_them(tmp_path: Path) -> None:
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    config.write_text(config.read_text().replace('name = "lyon"', 'name = ""'))
    code, checks = check(config)
    assert code == 1
    assert checks["settings"]["status"] == "failed" and "setting 'name'" in checks["settings"]["detail"]
    assert {checks[n]["status"] for n in ("store", "tls", "data", "coordinator", "device")} == {"skipped"}


def test_the_device_check_times_a_training_step_on_the_cpu(site: Path) -> None:
    _, checks = check(site)
    device = checks["device"]
    assert device["status"] == "ok" and device["device"].startswith("cpu (CPU")
    assert device["preset"] == "tiny" and device["batch"] == 8 and device["ms_per_step"] > 0
    assert "ms/step" in device["detail"]
