"""The site's approval page (`cardiofl site ui`): its token, its same-origin rule, and approvals as the CLI's."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from shared.study.description import describe
from site_agent.approvals import study_key
from site_agent.cli import approvals as cli_approvals
from site_agent.cli import ui as cli_ui
from site_agent.cli.app import site_app
from site_agent.ui.server import SiteUi, create_app, new_token
from tests.coordinator.factories import ADMIN, create_study, enrol, offer
from tests.site_agent.test_agent import SITES
from tests.site_agent.test_startup_data import _clean_environ_and_signals, agent_config, valid_source

__all__ = ["_clean_environ_and_signals"]

runner = CliRunner()
ORIGIN = "http://testserver"
DP = {"noise_multiplier": 1.0, "clip_norm": 1.0}


class Page:
    """The page's API as its JS calls it: the token as a bearer header, same-origin JSON POSTs."""

    def __init__(self, ui: SiteUi) -> None:
        self.ui = ui
        self.http = TestClient(create_app(ui, allowed_hosts=("testserver",)))

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.ui.token}", "Origin": ORIGIN, **extra}

    def state(self) -> dict[str, Any]:
        response = self.http.get("/api/state", headers=self.headers())
        assert response.status_code == 200, response.text
        shown: dict[str, Any] = response.json()
        return shown

    def post(self, study_id: int, action: str, body: dict[str, str] | None = None, **headers: str) -> httpx.Response:
        response: httpx.Response = self.http.post(
            f"/api/studies/{study_id}/{action}", json=body or {}, headers=self.headers(**headers)
        )
        return response


@pytest.fixture()
def site(tmp_path: Path, coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, str]]:
    """Site lyon's config, the CLI's and the page's clients talking to the in-process coordinator; (config, headers)."""
    headers = enrol(coordinator, "lyon")
    enrol(coordinator, "oslo")
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])

    def site_http(settings: object) -> httpx.Client:
        return httpx.Client(transport=coordinator._transport, base_url=str(coordinator.base_url), headers=headers)

    monkeypatch.setattr(cli_approvals, "site_http", site_http)
    monkeypatch.setattr(cli_ui, "site_http", site_http)
    return config, headers


def page_of(config: Path) -> Page:
    return Page(cli_ui.site_ui(config, new_token()))


def approval_of(coordinator: TestClient, study_id: int) -> str:
    return str(coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["approvals"]["lyon"])


def test_the_api_answers_only_with_the_pages_token(site: tuple[Path, dict[str, str]], coordinator: TestClient) -> None:
    config, _ = site
    study_id = create_study(coordinator, list(SITES))
    page = page_of(config)
    assert page.http.get("/api/state").status_code == 401
    assert page.http.get("/api/state", headers={"Authorization": "Bearer " + "x" * 43}).status_code == 401
    assert page.http.get("/api/state", headers={"Authorization": page.ui.token}).status_code == 401  # no scheme
    digest = page.state()["studies"][0]["digest"]
    refused = page.http.post(f"/api/studies/{study_id}/approve", json={"digest": digest}, headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert page.ui.approvals.store.approved_studies() == []
    shown = page.http.get("/")  # the page itself holds no data; its headers forbid framing and other scripts
    assert shown.status_code == 200 and "Offered studies" in shown.text
    assert "frame-ancestors 'none'" in shown.headers["content-security-policy"]
    assert shown.headers["x-frame-options"] == "DENY" and "set-cookie" not in shown.headers
    assert page.http.get("/static/server.py").status_code == 404


def test_approve_records_exactly_what_the_cli_records(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, headers = site
    study_id = create_study(coordinator, list(SITES))
    offered = offer(coordinator, headers, study_id)
    key = study_key(study_id, offered.study_uid)
    digest = describe(offered.terms, study_uid=offered.study_uid, site="lyon", protocol=offered.protocol).digest()
    result = runner.invoke(site_app, ["approve", str(study_id), "--config", str(config), "--digest", digest])
    assert result.exit_code == 0, result.output
    by_cli = page_of(config).ui.approvals.store.load_approval(key)
    assert by_cli is not None
    result = runner.invoke(site_app, ["revoke-approval", str(study_id), "--config", str(config)])
    assert result.exit_code == 0, result.output

    page = page_of(config)
    (shown,) = page.state()["studies"]
    assert shown["state"] == "awaiting approval" and shown["digest"] == digest
    assert shown["lines"] == cli_approvals.describe_lines(page.ui.approvals.decide(offered).description)
    approved = page.post(study_id, "approve", {"digest": digest})
    assert approved.status_code == 200, approved.text
    assert approved.json()["message"].startswith(f"approved study {study_id} (digest {digest})")
    by_page = page.ui.approvals.store.load_approval(key)
    assert by_page is not None
    assert by_page.pop("approved_at") and by_cli.pop("approved_at")
    assert by_page == by_cli  # the same digest, description, study and operator
    assert approval_of(coordinator, study_id) == "approved"
    state = page.state()
    assert state["studies"][0]["state"] == "approved"
    assert [row["key"] for row in state["site"]["approved"]] == [key]
    assert (
        page.post(study_id, "approve", {"digest": digest}).json()["message"] == f"study {study_id} is already approved"
    )


def test_a_digest_other_than_the_current_one_is_refused(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, _ = site
    study_id = create_study(coordinator, list(SITES))
    page = page_of(config)
    refused = page.post(study_id, "approve", {"digest": "a" * 64})
    assert refused.status_code == 409 and "not the" in refused.json()["detail"]
    assert page.post(study_id, "approve", {"digest": "not a digest"}).status_code == 422
    assert page.post(study_id + 100, "approve", {"digest": "a" * 64}).status_code == 404
    assert page.ui.approvals.store.approved_studies() == []
    assert approval_of(coordinator, study_id) == "not reported"


def test_revoke_removes_the_approval_and_tells_the_coordinator(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, _ = site
    study_id = create_study(coordinator, list(SITES))
    page = page_of(config)
    digest = page.state()["studies"][0]["digest"]
    assert page.post(study_id, "approve", {"digest": digest}).status_code == 200
    revoked = page.post(study_id, "revoke")
    assert revoked.status_code == 200 and revoked.json()["message"].startswith(
        f"revoked the approval of study {study_id}"
    )
    assert page.ui.approvals.store.approved_studies() == []
    assert approval_of(coordinator, study_id) == "awaiting approval"
    assert page.state()["studies"][0]["state"] == "awaiting approval"
    assert page.post(study_id, "revoke").status_code == 404


def test_a_cross_origin_or_non_json_change_is_refused(
    site: tuple[Path, dict[str, str]], coordinator: TestClient
) -> None:
    config, _ = site
    study_id = create_study(coordinator, list(SITES))
    page = page_of(config)
    body = {"digest": page.state()["studies"][0]["digest"]}
    assert page.post(study_id, "approve", body, Origin="http://evil.example").status_code == 403
    assert page.post(study_id, "approve", body, Origin="null").status_code == 403
    assert page.post(study_id, "approve", body, **{"Sec-Fetch-Site": "cross-site"}).status_code == 403
    no_origin = {"Authorization": f"Bearer {page.ui.token}"}
    assert page.http.post(f"/api/studies/{study_id}/approve", json=body, headers=no_origin).status_code == 403
    form = page.http.post(f"/api/studies/{study_id}/approve", data=body, headers=page.headers())
    assert form.status_code == 415
    rebound = page.http.get("/api/state", headers={**page.headers(), "Host": "evil.example"})
    assert rebound.status_code == 400  # a DNS-rebound name is not this server's
    assert page.ui.approvals.store.approved_studies() == []
    assert approval_of(coordinator, study_id) == "not reported"


def test_the_page_shows_what_changed_since_an_approval_and_the_sites_state(
    site: tuple[Path, dict[str, str]], coordinator: TestClient, tmp_path: Path
) -> None:
    config, headers = site
    study_id = create_study(coordinator, list(SITES), aggregation={"name": "equal"}, privacy={"dp": DP})
    offered = offer(coordinator, headers, study_id)
    heartbeat = tmp_path / "heartbeat"
    heartbeat.write_text(f"{time.time() - 30:.0f}\n")
    page = page_of(config)
    page.ui = replace(page.ui, heartbeat=heartbeat)
    page.http = TestClient(create_app(page.ui, allowed_hosts=("testserver",)))
    earlier = offered.terms.model_copy(update={"rounds": offered.terms.rounds + 5})
    description = describe(earlier, study_uid=offered.study_uid, site="lyon", protocol=offered.protocol)
    page.ui.approvals.approve(offered, by="operator earlier", description=description)

    state = page.state()
    (shown,) = state["studies"]
    assert shown["state"] == "approval outdated" and shown["changes"] == ["rounds"]
    assert shown["recorded"]["digest"] == description.digest() != shown["digest"]
    assert shown["summary"]["adversary"] is None  # no secure aggregation in these terms
    assert shown["summary"]["epsilon"].startswith("epsilon ") and "delta 1e-05" in shown["summary"]["epsilon"]
    assert 25 <= state["site"]["last_poll"]["age_s"] <= 60
    (row,) = state["site"]["approved"]
    assert row["approved_by"] == "operator earlier" and row["latest_round"] is None
    assert state["site"]["pending_uploads"] == [] and state["error"] is None


def test_the_command_listens_on_127_0_0_1_and_prints_the_url_with_a_fresh_token(
    site: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = site
    served: list[tuple[str, int]] = []

    def run(server: object, sockets: list[Any]) -> None:
        served.extend(sock.getsockname() for sock in sockets)
        for sock in sockets:
            sock.close()

    monkeypatch.setattr("uvicorn.Server.run", run)
    urls = []
    for _ in range(2):
        cli_ui.ui_command(config=config, port=0)
        urls.append(capsys.readouterr().out.splitlines()[-1].strip())
    assert [host for host, _ in served] == ["127.0.0.1", "127.0.0.1"]
    for url, (_, port) in zip(urls, served, strict=True):
        assert url.startswith(f"http://127.0.0.1:{port}/#token=") and len(url.split("token=")[1]) >= 43
    assert urls[0].split("token=")[1] != urls[1].split("token=")[1]
