"""The site's approval page (`cardiofl site ui`) in a real headless Chromium: keyboard only, and axe-core."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from cardiofl.demo import free_port
from site_agent.cli import approvals as cli_approvals
from site_agent.cli import ui as cli_ui
from site_agent.ui.server import create_app, new_token
from tests.coordinator.factories import ADMIN, create_study, enrol
from tests.e2e.test_dashboard import ARTIFACTS, AXE_DIR, chromium_or_skip, node_checks_or_skip
from tests.site_agent.test_agent import SITES
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals"]


@pytest.fixture()
def page_url(tmp_path: Path, coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    """Site lyon's approval page under uvicorn on 127.0.0.1, one study offered; (its URL with the token, study id)."""
    headers = enrol(coordinator, "lyon")
    enrol(coordinator, "oslo")
    study_id = create_study(coordinator, list(SITES))
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])

    def site_http(settings: object) -> httpx.Client:
        return httpx.Client(transport=coordinator._transport, base_url=str(coordinator.base_url), headers=headers)

    monkeypatch.setattr(cli_approvals, "site_http", site_http)
    monkeypatch.setattr(cli_ui, "site_http", site_http)
    ui = cli_ui.site_ui(config, new_token())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ui), host="127.0.0.1", port=port, log_level="warning", ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/#token={ui.token}", study_id
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def test_keyboard_only_approve_revoke_then_decline_with_no_axe_violations(
    page_url: tuple[str, int], coordinator: TestClient
) -> None:
    url, study_id = page_url
    chromium_path, node = chromium_or_skip(), node_checks_or_skip()
    ARTIFACTS.mkdir(exist_ok=True)
    run = subprocess.run(
        [node, "site_ui_checks.mjs", chromium_path, url, str(ARTIFACTS / "site-ui.png")],
        cwd=AXE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    checks = json.loads(run.stdout.strip().splitlines()[-1])
    assert checks["errors"] == []
    assert checks["violations"] == [] and checks["violationsApproved"] == [] and checks["violationsDeclined"] == []
    assert "token=" not in checks["addressBar"]  # the page takes the token out of the address bar
    assert checks["tabsToApprove"] is not None and checks["tabsToRevoke"] is not None
    assert checks["approved"]["state"] == "approved"
    assert checks["approved"]["focused"] == f"study-{study_id}-title"  # focus stays on the study acted on
    assert checks["revoked"]["state"] == "awaiting approval"
    assert checks["tabsToReason"] is not None and checks["declineFocused"] == "decline"
    declined = checks["declined"]
    assert declined["state"] == "declined" and declined["focused"] == f"study-{study_id}-title"
    reason = "Our ethics board has not cleared this cohort"
    assert declined["reason"] == reason and declined["declines"] == [reason]  # on the study, and in the site's state
    approvals = coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["approvals"]
    assert approvals["lyon"] == "declined"  # approved, revoked, then declined: the coordinator was told each
