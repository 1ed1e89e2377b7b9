"""The coordinator's log lines: CARDIOFL_LOG_FORMAT and CARDIOFL_LOG_LEVEL, for its own, uvicorn's and Alembic's."""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner
from uvicorn.config import LOGGING_CONFIG

from cardiofl.cli import app
from coordinator.serving.process import server_log_config
from tests.conftest import ADMIN_TOKEN
from tests.coordinator.conftest import wait_serving
from tests.coordinator.factories import running_study, train_and_upload
from tests.shared.test_logs import captured_json_lines

CARDIOFL = str(Path(sys.executable).parent / "cardiofl")  # the installed console script
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
REQUIRED = {"time", "level", "logger", "message"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(tmp_path: Path, **variables: str) -> tuple[str, str]:
    """Run `cardiofl coordinator serve` on a new SQLite database, ask it a few things, stop it: (stdout, stderr)."""
    port = _free_port()
    env = {
        **os.environ,
        "CARDIOFL_DATABASE_URL": f"sqlite:///{tmp_path / 'coordinator.db'}",
        "CARDIOFL_ADMIN_TOKEN": ADMIN_TOKEN,
        **variables,
    }
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        server = subprocess.Popen(
            [CARDIOFL, "coordinator", "serve", "--port", str(port)],
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serving(lambda: httpx.get(f"{base}/api/v1/health", timeout=1), server, err.read_text)
        assert httpx.post(f"{base}/api/v1/sites", json={"name": "lyon"}, headers=ADMIN).status_code == 201
        assert httpx.get(f"{base}/api/v1/status", headers=ADMIN).status_code == 200
        assert httpx.get(f"{base}/api/v1/status").status_code == 401
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)  # uvicorn stops gracefully, then re-raises the signal it caught
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return out.read_text(), err.read_text()


def test_serve_in_json_writes_only_json_lines_its_own_uvicorns_and_alembics(tmp_path: Path) -> None:
    stdout, stderr = _serve(tmp_path, CARDIOFL_LOG_FORMAT="json", CARDIOFL_LOG_LEVEL="DEBUG")
    text_lines = (stdout + stderr).splitlines()
    assert len(text_lines) > 10
    lines = [json.loads(line) for line in text_lines]  # every line is one JSON object
    assert all(isinstance(line, dict) and REQUIRED <= set(line) for line in lines), lines
    loggers = {line["logger"] for line in lines}
    assert {"uvicorn.error", "uvicorn.access", "alembic.runtime.migration", "coordinator.main"} <= loggers, loggers
    assert "DEBUG" in {line["level"] for line in lines}  # CARDIOFL_LOG_LEVEL=DEBUG reaches Alembic's lines too
    messages = [line["message"] for line in lines]
    assert any(m.startswith("Started server process") for m in messages)
    assert any(m.startswith("Running upgrade") for m in messages)  # the migrations run before uvicorn starts
    assert any('"POST /api/v1/sites HTTP/1.1" 201' in m for m in messages)  # the access log
    assert any('"GET /api/v1/status HTTP/1.1" 401' in m for m in messages)
    assert any(m.startswith("settings in force:") and "log_format=json" in m for m in messages)
    assert ADMIN_TOKEN not in stdout + stderr


def test_serve_at_warning_drops_every_info_line_uvicorns_and_alembics_included(tmp_path: Path) -> None:
    stdout, stderr = _serve(tmp_path, CARDIOFL_LOG_FORMAT="json", CARDIOFL_LOG_LEVEL="warning")
    lines = [json.loads(line) for line in (stdout + stderr).splitlines()]
    assert all(line["level"] in ("WARNING", "ERROR") for line in lines), lines  # no startup, access or migration


def test_serve_in_text_by_default_looks_as_it_always_did(tmp_path: Path) -> None:
    stdout, stderr = _serve(tmp_path)
    for line in (stdout + stderr).splitlines():
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)
    ours = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO"
    assert re.search(rf"^{ours} coordinator\.main: settings in force: database_url=", stderr, re.M), stderr
    assert re.search(rf"^{ours} alembic\.runtime\.migration: Running upgrade ", stderr, re.M), stderr
    assert re.search(r"^INFO:     Started server process \[\d+\]$", stderr, re.M), stderr  # uvicorn's own look
    assert re.search(r'^INFO:     127\.0\.0\.1:\d+ - "POST /api/v1/sites HTTP/1\.1" 201 Created$', stdout, re.M)


@pytest.mark.parametrize(
    ("command", "variable", "value", "error"),
    [
        ("serve", "CARDIOFL_LOG_FORMAT", "xml", "error: CARDIOFL_LOG_FORMAT must be one of text, json, not 'xml'"),
        (
            "migrate",
            "CARDIOFL_LOG_LEVEL",
            "LOUD",
            "error: CARDIOFL_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, not 'LOUD'",
        ),
    ],
    ids=["serve-format", "migrate-level"],
)
def test_a_bad_log_setting_stops_the_coordinator_in_one_line(
    tmp_path: Path, command: str, variable: str, value: str, error: str
) -> None:
    env = {"CARDIOFL_DATABASE_URL": f"sqlite:///{tmp_path / 'coordinator.db'}", variable: value}
    result = CliRunner().invoke(app, ["coordinator", command], env=env)
    assert result.exit_code == 2 and result.output == error + "\n", result.output
    assert not (tmp_path / "coordinator.db").exists()  # stopped before anything was done


def test_uvicorns_loggers_keep_their_look_in_text_and_join_the_root_in_json() -> None:
    text = server_log_config("text", "DEBUG")
    assert text["loggers"]["uvicorn.access"] == {**LOGGING_CONFIG["loggers"]["uvicorn.access"], "level": "DEBUG"}
    assert text["formatters"]["default"] == LOGGING_CONFIG["formatters"]["default"]
    assert text["root"] == {"level": "DEBUG", "handlers": ["cardiofl"]}
    json_config = server_log_config("json", "WARNING")
    assert set(json_config["formatters"]) == {"cardiofl"} and json_config["root"]["level"] == "WARNING"
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        assert json_config["loggers"][name] == {"handlers": [], "level": "WARNING", "propagate": True}


@pytest.fixture()
def round_lines() -> Iterator[io.StringIO]:
    """The JSON lines of coordinator.rounds at INFO, as a JSON coordinator writes them."""
    with captured_json_lines("coordinator.rounds") as stream:
        yield stream


def test_the_round_closing_lines_name_the_study_and_round(client: TestClient, round_lines: io.StringIO) -> None:
    study_id, headers = running_study(client, sites=("lyon",))
    assert train_and_upload(client, headers["lyon"], 1.0, 10).status_code == 201
    lines = [json.loads(line) for line in round_lines.getvalue().splitlines()]
    (completed,) = [line for line in lines if "completed with 1 update(s)" in line["message"]]
    assert (completed["study"], completed["round"], completed["logger"]) == (
        study_id,
        1,
        "coordinator.rounds.closing",
    )
    opened = {line["round"]: line for line in lines if "opened for 1 site(s)" in line["message"]}
    assert set(opened) == {1, 2} and all(line["study"] == study_id for line in opened.values())
