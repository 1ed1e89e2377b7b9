"""Every `cardiofl site ...` command the site's commands print runs as printed, pasted in the same environment."""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from site_agent.approvals import Approvals
from site_agent.cli import approvals as cli_approvals
from site_agent.cli.model import config_flag
from site_agent.client import CoordinatorClient
from site_agent.config import load_settings, open_store, site_command, store_key
from tests.coordinator.factories import create_study, enrol
from tests.site_agent.test_agent import SITES
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals"]

runner = CliRunner()
HINT = re.compile(r"(cardiofl site [^`\n]*)")


@pytest.fixture()
def site_config(tmp_path: Path, coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Site lyon's config file, its commands talking to the in-process coordinator."""
    headers = enrol(coordinator, "lyon")
    enrol(coordinator, "oslo")
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    monkeypatch.setattr(
        cli_approvals,
        "site_http",
        lambda settings: httpx.Client(
            transport=coordinator._transport, base_url=str(coordinator.base_url), headers=headers
        ),
    )
    return config


def hints(output: str) -> list[str]:
    """The `cardiofl site ...` commands in a command's output."""
    return [match.group(1).strip() for match in HINT.finditer(output)]


def run_hint(hint: str) -> tuple[int, str]:
    """Run a printed hint as a person pasting it would."""
    argv = shlex.split(hint)
    assert argv[:2] == ["cardiofl", "site"], hint
    result = runner.invoke(app, argv[1:])
    return result.exit_code, result.output


def test_the_approve_hint_of_site_studies_runs_as_printed(site_config: Path, coordinator: TestClient) -> None:
    study_id = create_study(coordinator, list(SITES))
    result = runner.invoke(app, ["site", "studies", "--config", str(site_config)])
    assert result.exit_code == 0, result.output
    printed = hints(result.output)
    assert printed and printed[0].startswith(f"cardiofl site approve {study_id} --config {site_config} --digest ")
    for hint in printed:
        code, output = run_hint(hint)
        assert code == 0 and f"approved study {study_id}" in output, (hint, output)


def test_the_hint_of_a_changed_digest_runs_as_printed(site_config: Path, coordinator: TestClient) -> None:
    study_id = create_study(coordinator, list(SITES))
    result = runner.invoke(app, ["site", "approve", str(study_id), "--config", str(site_config), "--digest", "a" * 64])
    assert result.exit_code == 1
    (hint,) = hints(result.output)
    assert hint == f"cardiofl site studies --config {site_config}"
    code, output = run_hint(hint)
    assert code == 0 and "awaiting approval" in output, output


def test_settings_from_the_environment_print_hints_without_config(
    site_config: Path, coordinator: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in tomllib.loads(site_config.read_text()).items():
        monkeypatch.setenv(f"CARDIOFL_SITE_{key.upper()}", value if isinstance(value, str) else json.dumps(value))
    study_id = create_study(coordinator, list(SITES))
    result = runner.invoke(app, ["site", "studies"])
    assert result.exit_code == 0, result.output
    (hint,) = hints(result.output)
    assert hint.startswith(f"cardiofl site approve {study_id} --digest ")
    code, output = run_hint(hint)
    assert code == 0 and f"approved study {study_id}" in output, output


def test_a_config_path_with_a_space_is_quoted() -> None:
    assert config_flag(None) == ""
    assert shlex.split(f"cardiofl site studies{config_flag(Path('my site/site.toml'))}")[-1] == "my site/site.toml"


def test_the_keygen_hint_of_a_missing_store_key_runs_as_printed(site_config: Path, tmp_path: Path) -> None:
    key = tmp_path / "store.key"
    key.unlink()
    result = runner.invoke(app, ["site", "studies", "--config", str(site_config)])
    assert result.exit_code != 0
    (hint,) = hints(result.output)
    assert hint == f"cardiofl site keygen --out {key}"
    code, output = run_hint(hint)
    assert code == 0 and key.is_file(), output
    assert runner.invoke(app, ["site", "studies", "--config", str(site_config)]).exit_code == 0


def test_the_hint_of_an_older_copy_of_the_store_runs_once_its_approvals_are_removed(
    site_config: Path, coordinator: TestClient, tmp_path: Path
) -> None:
    study_id = create_study(coordinator, list(SITES))
    approve = ["site", "approve", str(study_id), "--config", str(site_config), "--yes"]
    assert runner.invoke(app, approve).exit_code == 0
    shutil.copytree(tmp_path / "store", tmp_path / "backup")
    assert runner.invoke(app, ["site", "revoke-approval", str(study_id), "--config", str(site_config)]).exit_code == 0
    shutil.rmtree(tmp_path / "store")
    shutil.copytree(tmp_path / "backup", tmp_path / "store")  # restored: the revoked approval is back

    result = runner.invoke(app, ["site", "studies", "--config", str(site_config)])
    assert result.exit_code == 3 and "an older copy of the store" in result.output, result.output
    (hint,) = hints(result.output)
    assert hint == f"cardiofl site studies --config {site_config}"
    shutil.rmtree(tmp_path / "store" / "approvals")  # as the message says
    code, output = run_hint(hint)
    assert code == 0 and "awaiting approval" in output, output


def test_the_agents_log_hint_of_a_study_awaiting_approval_runs_as_printed(
    site_config: Path, coordinator: TestClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    study_id = create_study(coordinator, list(SITES))
    settings = load_settings(site_config)
    approvals = Approvals(open_store(settings, store_key(settings)), studies_command=site_command(settings, "studies"))
    client = CoordinatorClient(cli_approvals.site_http(settings))
    with caplog.at_level(logging.WARNING, logger="site_agent.approvals"):
        approvals.sync(client)  # what the agent does at each poll
    (logged,) = [r.getMessage() for r in caplog.records if f"study {study_id} awaits" in r.getMessage()]
    (hint,) = hints(logged)
    assert hint == f"cardiofl site studies --config {site_config}"
    code, output = run_hint(hint)  # it lists the study, and the approve command that runs as printed
    assert code == 0 and f"cardiofl site approve {study_id} --config {site_config} --digest " in output, output
