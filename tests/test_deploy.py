"""deploy/: every setting is documented, and every command the containers run exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cardiofl.cli import app
from coordinator.config import CoordinatorSettings
from shared.protocol import StudyConfig
from site_agent.config import ENV_PREFIX, AgentSettings

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def documented() -> set[str]:
    return set(re.findall(r"^(CARDIOFL_[A-Z_]+)=", (DEPLOY / "env.example").read_text(), flags=re.M))


def test_env_example_documents_every_setting() -> None:
    names = documented()
    coordinator = {f"CARDIOFL_{field.upper()}" for field in CoordinatorSettings.model_fields}
    agent = {f"{ENV_PREFIX}{field.upper()}" for field in AgentSettings.model_fields}
    assert coordinator <= names, coordinator - names
    assert agent <= names, agent - names
    assert {"CARDIOFL_URL", "CARDIOFL_TOKEN"} <= names


def cardiofl_commands() -> list[list[str]]:
    """The `cardiofl <group> <command>` words of every command line in deploy/."""
    found = set()
    for path in DEPLOY.iterdir():
        if path.suffix not in (".yaml", ".Dockerfile") and not path.name.endswith("Dockerfile"):
            continue
        lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        text = " ".join(lines).replace('", "', " ").replace('"', " ").replace("[", " ").replace(",", " ")
        for match in re.finditer(r"(?:^|[\s;&|])cardiofl ([a-z][a-z-]*) ([a-z][a-z-]*)", text):
            found.add((match.group(1), match.group(2)))
    return [list(pair) for pair in sorted(found)]


@pytest.mark.parametrize("words", cardiofl_commands(), ids=lambda w: " ".join(w))
def test_every_command_in_deploy_exists(words: list[str]) -> None:
    result = CliRunner().invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output


def test_commands_were_found() -> None:
    commands = {" ".join(w) for w in cardiofl_commands()}
    assert {
        "site run",
        "site keygen",
        "site health",
        "site enroll",
        "coordinator serve",
        "coordinator migrate",
        "study create",
        "data synth",
    } <= commands


def test_compose_agent_environment_parses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    data = re.search(r"CARDIOFL_SITE_DATA: '(.+)'", text)
    assert data is not None
    monkeypatch.setenv("CARDIOFL_SITE_NAME", "site-1")
    monkeypatch.setenv("CARDIOFL_SITE_COORDINATOR_URL", "http://coordinator:8000")
    monkeypatch.setenv("CARDIOFL_SITE_DATA", data.group(1))
    settings = AgentSettings()
    assert settings.data[0].kind == "challenge" and str(settings.data[0].path) == "/data/site_00"


@pytest.mark.parametrize("name", ["study.compose.toml", "study.example.toml"])
def test_study_files_are_valid(name: str) -> None:
    raw = tomllib.loads((DEPLOY / name).read_text())
    raw.pop("name")
    StudyConfig.model_validate(raw)


def test_dockerfiles_run_as_non_root_with_healthchecks() -> None:
    for name in ("site-agent.Dockerfile", "coordinator.Dockerfile"):
        text = (DEPLOY / name).read_text()
        assert re.search(r"^USER cardiofl$", text, flags=re.M), name
        assert "HEALTHCHECK" in text, name
    agent = (DEPLOY / "site-agent.Dockerfile").read_text()
    assert agent.startswith("#") and "FROM nvidia/cuda:" in agent


def test_dockerfiles_copy_every_package_the_wheel_installs() -> None:
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    packages = {name for name in pyproject["tool"]["setuptools"]["packages"] if "." not in name}
    assert {"cardiofl", "coordinator", "site_agent", "shared"} <= packages
    for name in ("site-agent.Dockerfile", "coordinator.Dockerfile"):
        copied = set(re.findall(r"^COPY (\w+) /src/\1$", (DEPLOY / name).read_text(), flags=re.M))
        assert packages <= copied, (name, packages - copied)


def _sourced_env_example() -> dict[str, str]:
    """The variables `set -a; . deploy/env.example` exports: each value up to its comment, blanks included."""
    return {
        name: value.split("#", 1)[0].strip()
        for name, value in re.findall(r"^([A-Z_]+)=(.*)$", (DEPLOY / "env.example").read_text(), flags=re.M)
    }


def test_settings_read_from_a_sourced_env_example_take_empty_values_as_unset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from site_agent.config import load_settings

    exported = _sourced_env_example()
    assert exported["CARDIOFL_SITE_DATA"] == ""  # the case that once broke the agent at start
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "site.toml"
    config.write_text(
        'name = "lyon"\ncoordinator_url = "http://127.0.0.1:8000"\n'
        f'store_dir = "{tmp_path / "store"}"\n[[data]]\nkind = "challenge"\npath = "{tmp_path}"\n'
    )
    settings = load_settings(config)
    assert settings.name == "lyon" and len(settings.data) == 1  # the file's values stand, empty variables do not
    assert CoordinatorSettings(_env_file=None).admin_token is None  # empty: no bootstrap admin
