"""A token the coordinator refuses (401: revoked or unknown) stops the agent; a coordinator that fails is waited for."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import site_agent.tls
from cardiofl.cli import app
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals"]

runner = CliRunner()


def test_a_refused_token_stops_the_agent_after_transient_failures_are_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = [503, 502, 401]
    asked: list[str] = []

    def coordinator(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        status = answers.pop(0) if answers else 401
        body = {"error": {"code": "unauthenticated" if status == 401 else "unavailable", "message": "no such token"}}
        return httpx.Response(status, json=body)

    def fake_client(url: str, *args: object, **kwargs: object) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(coordinator), base_url=url)

    monkeypatch.setattr(site_agent.tls, "http_client", fake_client)
    monkeypatch.setenv("CARDIOFL_SITE_POLL_INTERVAL_S", "0.01")
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    result = runner.invoke(app, ["site", "run", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert asked == ["/api/v1/sites/me"] * 3  # the 5xx answers retried, the 401 not
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "the coordinator refused this site's token (revoked or unknown)" in line
    assert "ask its operator for a new one" in line and "CARDIOFL_SITE_TOKEN" in line
