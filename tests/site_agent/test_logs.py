"""The agent's log lines: CARDIOFL_LOG_FORMAT and CARDIOFL_LOG_LEVEL (or its own settings), and what each is about."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from site_agent.config import load_settings
from tests.shared.test_logs import captured_json_lines
from tests.site_agent.test_agent import Site, site_data, sites, start_study
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals", "site_data", "sites"]  # fixtures used here

REQUIRED = {"time", "level", "logger", "message"}


def test_a_json_agent_process_writes_only_json_lines_that_name_its_site(tmp_path: Path) -> None:
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    with config.open("a") as file:
        file.write('poll_interval_s = 0.2\nmax_backoff_s = 0.5\nlog_level = "WARNING"\n')
    env = {**os.environ, "CARDIOFL_LOG_FORMAT": "json", "CARDIOFL_LOG_LEVEL": "debug"}  # the variable wins the file
    agent = subprocess.Popen(
        [sys.executable, "-m", "cardiofl", "site", "run", "--config", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, lines = time.monotonic() + 60, []
        while time.monotonic() < deadline:  # the coordinator is down: the agent backs off and says so
            line = agent.stderr.readline()
            lines.append(line)
            if "coordinator unreachable" in line or not line:
                break
        agent.send_signal(signal.SIGTERM)
        stdout, rest = agent.communicate(timeout=30)
    finally:
        agent.kill()
    written = [line for line in "".join(lines).splitlines() + rest.splitlines() if line] + stdout.splitlines()
    parsed = [json.loads(line) for line in written]  # every line is one JSON object
    assert all(REQUIRED <= set(line) and line["site"] == "lyon" for line in parsed), parsed
    messages = {line["message"]: line for line in parsed}
    assert any(m.startswith("site lyon polling") for m in messages)
    assert any(m.startswith("coordinator unreachable") and line["level"] == "WARNING" for m, line in messages.items())
    assert "DEBUG" in {line["level"] for line in parsed}  # CARDIOFL_LOG_LEVEL=debug, over the file's WARNING
    assert "received SIGTERM; stopping" in messages and "stopped" in messages


def test_a_bad_log_level_stops_the_agent_in_one_line_naming_the_allowed_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    monkeypatch.setenv("CARDIOFL_LOG_LEVEL", "verbose")
    result = CliRunner().invoke(app, ["site", "run", "--config", str(config)])
    assert result.exit_code == 2
    assert result.stderr == (
        "error: setting 'log_level' (CARDIOFL_LOG_LEVEL, CARDIOFL_SITE_LOG_LEVEL or `log_level` in the config file) "
        "must be one of DEBUG, INFO, WARNING, ERROR, not 'verbose'\n"
    )
    assert not (tmp_path / "cache").exists()  # stopped before the data were opened


def test_the_shared_variables_stand_below_the_agents_own_and_above_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    with config.open("a") as file:
        file.write('log_level = "ERROR"\nlog_format = "json"\n')
    assert (load_settings(config).log_level, load_settings(config).log_format) == ("ERROR", "json")
    monkeypatch.setenv("CARDIOFL_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("CARDIOFL_LOG_FORMAT", "text")
    assert (load_settings(config).log_level, load_settings(config).log_format) == ("DEBUG", "text")
    monkeypatch.setenv("CARDIOFL_SITE_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("CARDIOFL_LOG_FORMAT", "")  # empty: unset, as every CARDIOFL_SITE_* variable
    assert (load_settings(config).log_level, load_settings(config).log_format) == ("WARNING", "json")
    assert load_settings(config, log_level="INFO").log_level == "INFO"


@pytest.fixture()
def agent_lines() -> Iterator[io.StringIO]:
    """The JSON lines of site_agent at INFO, as a JSON agent writes them."""
    with captured_json_lines("site_agent") as stream:
        yield stream


def test_the_lines_of_a_task_name_its_study_round_and_site(
    coordinator: TestClient, sites: dict[str, Site], agent_lines: io.StringIO
) -> None:
    study_id = start_study(coordinator, rounds=1)
    assert sites["lyon"].worker.poll_once()
    lines = [json.loads(line) for line in agent_lines.getvalue().splitlines()]
    task = [line for line in lines if line["message"].startswith(f"study {study_id} round 1:")]
    said = " ".join(line["message"] for line in task)
    assert "training on" in said and "uploaded" in said
    assert all((line["study"], line["round"], line["site"]) == (study_id, 1, "lyon") for line in task), task
    assert all(REQUIRED <= set(line) for line in lines)
