import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect
from typer.testing import CliRunner

from cardiofl.cli import app
from coordinator.db import make_engine
from coordinator.main import create_app
from tests.conftest import ADMIN_TOKEN, coordinator_settings_for
from tests.coordinator.conftest import wait_serving
from tests.coordinator.factories import site_headers

runner = CliRunner()


def test_migrate_builds_the_schema(empty_database_url: str) -> None:
    result = runner.invoke(app, ["coordinator", "migrate"], env={"CARDIOFL_DATABASE_URL": empty_database_url})
    assert result.exit_code == 0, result.output
    engine = make_engine(empty_database_url)
    with engine.connect() as connection:
        assert {"studies", "rounds", "updates", "alembic_version"} <= set(inspect(connection).get_table_names())
    engine.dispose()


def test_create_token_prints_a_working_secret_once(empty_database_url: str) -> None:
    env = {"CARDIOFL_DATABASE_URL": empty_database_url}
    result = runner.invoke(app, ["coordinator", "create-token", "--role", "admin", "--label", "ops"], env=env)
    assert result.exit_code == 0, result.output
    secret = result.output.strip().splitlines()[-1]
    assert secret.startswith("cfl_")
    with TestClient(create_app(coordinator_settings_for(empty_database_url, admin_token=None))) as client:
        response = client.post("/api/v1/sites", json={"name": "lyon"}, headers={"Authorization": f"Bearer {secret}"})
        assert response.status_code == 201
        listed = client.get("/api/v1/tokens", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
        assert secret not in str(listed) and listed[0]["label"] == "ops"


def test_create_token_refuses_unknown_roles(empty_database_url: str) -> None:
    result = runner.invoke(
        app, ["coordinator", "create-token", "--role", "king"], env={"CARDIOFL_DATABASE_URL": empty_database_url}
    )
    assert result.exit_code != 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_runs_under_uvicorn_with_several_workers(empty_database_url: str, tmp_path: Path) -> None:
    """Several workers serve one database; SIGTERM stops them at once, waiting long-polls included."""
    workers = "2" if empty_database_url.startswith("postgresql") else "1"
    port = _free_port()
    env = {**os.environ, "CARDIOFL_DATABASE_URL": empty_database_url, "CARDIOFL_ADMIN_TOKEN": ADMIN_TOKEN}
    cardiofl = str(Path(sys.executable).parent / "cardiofl")  # the installed console script
    command = [cardiofl, "coordinator", "serve", "--port", str(port), "--workers", workers]
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_serving(lambda: httpx.get(f"{base}/api/v1/health", timeout=1), server, log.read_text)
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        created = [httpx.post(f"{base}/api/v1/sites", json={"name": f"s{i}"}, headers=admin) for i in range(6)]
        assert [r.status_code for r in created] == [201] * 6
        status = httpx.get(f"{base}/api/v1/status", headers=admin).json()
        assert [s["name"] for s in status["sites"]] == [f"s{i}" for i in range(6)]
        if workers == "2":  # the second worker may still be starting when the first answers
            started = time.monotonic() + 60
            while log.read_text().count("Application startup complete") < 2 and time.monotonic() < started:
                time.sleep(0.2)
            assert log.read_text().count("Application startup complete") == 2, log.read_text()
        text = log.read_text()  # what is in force, said at start, with no secret in it
        assert "settings in force: database_url=" in text and "admin_token=set" in text, text
        assert ADMIN_TOKEN not in text

        # An idle connection outlives an agent's own 5 s keep-alive: the agent, not the server, drops it first.
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for pause in (0.0, 6.0):
            time.sleep(pause)
            connection.request("GET", "/api/v1/health")
            assert connection.getresponse().read()  # answered on the one connection: the server kept it open
        connection.close()

        # Every site waits (no study is open) in a 30 s long-poll; SIGTERM must not wait for them.
        answers: list[int | str] = []
        tokens = [r.json()["token"]["token"] for r in created]
        polls = [threading.Thread(target=_long_poll, args=(base, token, answers)) for token in tokens]
        for poll in polls:
            poll.start()
        time.sleep(2.0)  # every poll is now waiting in a worker
        assert answers == []
        asked = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        stopped_after = time.monotonic() - asked
        for poll in polls:
            poll.join(timeout=30)
        assert answers == [204] * len(tokens)  # answered "no task", not cut off
        assert stopped_after < 8, f"took {stopped_after:.1f}s to stop"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _long_poll(base: str, token: str, answers: list[int | str]) -> None:
    try:
        response = httpx.get(f"{base}/api/v1/tasks/next", params={"wait": 30}, headers=site_headers(token), timeout=60)
        answers.append(response.status_code)
    except httpx.HTTPError as error:
        answers.append(repr(error))


def test_the_settings_logged_at_start_hide_the_password_and_the_admin_token() -> None:
    from coordinator.config import CoordinatorSettings
    from coordinator.main import describe_settings

    settings = CoordinatorSettings(
        _env_file=None,
        database_url="postgresql+psycopg://ana:s3cret@db.example/cardiofl",
        admin_token="t0ken-Xq7Zr2Vn9Lk4Pw8Jb3Hc6Ty1MdUe5Gf0Ai",
    )
    line = describe_settings(settings)
    assert "database_url=postgresql+psycopg://ana:***@db.example/cardiofl" in line and "admin_token=set" in line
    assert "s3cret" not in line and "t0ken" not in line
    assert "aggregation_lease_s=30.0" in line


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("short", "at least 32 characters"),
        ("Xq7Zr2Vn9Lk4Pw8Jb3Hc6Ty1MdUe5Gf", "at least 32 characters"),  # 31
        ("a" * 40, "at least 16 distinct characters"),
        ("ab" * 20, "at least 16 distinct characters"),
        ("0123456789abcde" * 4, "at least 16 distinct characters"),  # 15 distinct
        ("  # bootstrap admin bearer token; empty disables it", "base64url"),  # env.example's comment
        ("a-long-enough-token with-a-space-Xq7Zr2Vn9Lk4", "base64url"),
        ("long#enough#but#hashed#Xq7Zr2Vn9Lk4Pw8Jb3Hc6", "base64url"),
        ("q0Zb+Yv9Jr2m/7WcX4kT1aLpE8sNd3uH5oQiGfR6tVw=", "base64url"),  # `openssl rand -base64 32`: + / =
    ],
)
def test_an_admin_token_that_is_not_a_generated_secret_is_refused_naming_the_setting(token: str, why: str) -> None:
    from pydantic import ValidationError

    from coordinator.config import CoordinatorSettings

    with pytest.raises(ValidationError) as refused:
        CoordinatorSettings(_env_file=None, admin_token=token)
    message = str(refused.value)
    assert "CARDIOFL_ADMIN_TOKEN" in message and why in message, message
    assert "make one with `cardiofl coordinator token generate`" in message


def test_generated_admin_tokens_are_accepted() -> None:
    from coordinator.config import CoordinatorSettings, admin_token_problem, generate_admin_token

    tokens = {generate_admin_token() for _ in range(200)}
    assert len(tokens) == 200 and {len(token) for token in tokens} == {43}
    for token in tokens:
        assert CoordinatorSettings(_env_file=None, admin_token=token).admin_token.get_secret_value() == token
    assert admin_token_problem("Xq7Zr2Vn9Lk4Pw8Jb3Hc6Ty1MdUe5Gf0") is None  # 32 characters, 32 distinct: the least


def test_token_generate_prints_a_token_the_settings_accept() -> None:
    from coordinator.config import CoordinatorSettings

    printed = []
    for _ in range(2):
        result = runner.invoke(app, ["coordinator", "token", "generate"])
        assert result.exit_code == 0, result.output
        assert result.output.endswith("\n") and result.output.count("\n") == 1, result.output
        printed.append(result.output.strip())
    assert printed[0] != printed[1]
    for token in printed:
        assert CoordinatorSettings(_env_file=None, admin_token=token).admin_token.get_secret_value() == token


def test_serve_refuses_a_weak_admin_token_in_one_line_that_hides_it(tmp_path: Path) -> None:
    env = {"CARDIOFL_DATABASE_URL": f"sqlite:///{tmp_path / 'coordinator.db'}", "CARDIOFL_ADMIN_TOKEN": "ab" * 20}
    result = runner.invoke(app, ["coordinator", "serve"], env=env)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: CARDIOFL_ADMIN_TOKEN (the bootstrap admin token) must hold at least 16")
    assert "cardiofl coordinator token generate" in result.output and "ab" * 20 not in result.output
