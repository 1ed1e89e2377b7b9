"""The dashboard in a real headless Chromium during a running study, and /metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import NoReturn

import httpx
import pytest

from tests.coordinator.factories import (
    approve,
    download,
    eval_stats,
    local_eval,
    shifted,
    site_headers,
    update_body,
)
from tests.e2e.conftest import LiveCoordinator

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
AXE_DIR = Path(__file__).resolve().parent / "axe"  # axe-core and puppeteer-core, pinned in its package.json


def chromium_or_skip() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is required in CI (.ci/run installs Debian's chromium package)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return CHROMIUM


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
    ]
    return subprocess.run([chromium_or_skip(), *flags, *args], capture_output=True, text=True, timeout=120, check=True)


def unavailable(reason: str) -> NoReturn:
    """Fail in CI, where .ci/run provides the tool; skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def node_checks_or_skip() -> str:
    """Node, with tests/e2e/axe's pinned packages installed (`npm ci` when they are missing or differ)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        unavailable("node and npm are required for the dashboard's accessibility checks (apt-get install nodejs npm)")
    pinned = json.loads((AXE_DIR / "package.json").read_text())["dependencies"]
    installed = {}
    for name in pinned:
        manifest = AXE_DIR / "node_modules" / name / "package.json"
        installed[name] = json.loads(manifest.read_text())["version"] if manifest.exists() else None
    if installed != pinned:
        install = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=AXE_DIR, capture_output=True, text=True, timeout=300
        )
        if install.returncode != 0:
            unavailable(f"npm ci in {AXE_DIR} failed:\n{install.stderr[-2000:]}")
    return node


class Cells(HTMLParser):
    """Collects text of <td data-field=...> inside <tr data-round=...> and rows with data-site."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, str], dict[str, str]] = {}
        self.sites: list[str] = []
        self._row: tuple[str, str] | None = None
        self._field: str | None = None
        self._table: str | None = None
        self.text: dict[str, str] = {}
        self._id: str | None = None
        self.approvals: dict[str, str] = {}  # site -> its approval of the selected study
        self._site: str | None = None
        self._approval = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
        if tag == "tr" and self._table == "rounds-table" and a.get("data-round"):
            self._row = (a["data-round"] or "", a.get("data-attempt") or "1")
            self.rows[self._row] = {}
        if tag == "tr" and self._table == "sites-table" and a.get("data-site"):
            self.sites.append(a["data-site"] or "")
            self._site = a["data-site"]
        if tag == "td" and self._site is not None and a.get("data-field") == "approval":
            self._approval = True
        if tag == "td" and self._row is not None and a.get("data-field"):
            self._field = a["data-field"]
        if a.get("id"):
            self._id = a["id"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._field = None
            self._approval = False
        if tag == "tr":
            self._row = None
            self._site = None
        if tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._approval and self._site is not None:
            self.approvals[self._site] = self.approvals.get(self._site, "") + data
        if self._row is not None and self._field is not None:
            self.rows[self._row][self._field] = self.rows[self._row].get(self._field, "") + data
        if self._id is not None and data.strip():
            self.text[self._id] = data.strip()
            self._id = None


def auroc(summary: dict) -> str:
    """A pooled macro-AUROC as the dashboard and `cardiofl study show` write it: ±bound (95% interval)."""
    bound, low, high = (summary[f"macro_auroc_{end}"] for end in ("bound", "low", "high"))
    return f"{summary['macro_auroc']:.3f}±{bound:.3f} ({low:.3f}–{high:.3f})"


@pytest.fixture()
def running_study(live_coordinator: LiveCoordinator) -> tuple[int, dict]:
    """A study of 3 rounds whose first 2 rounds completed; round 3 is open."""
    admin = live_coordinator.client()
    sites = {}
    for name in ("lyon", "oslo"):
        response = admin.post("/api/v1/sites", json={"name": name})
        sites[name] = site_headers(response.json()["token"]["token"])
    config = {"model": {"preset": "tiny", "heads": "6:2"}, "sites": list(sites), "rounds": 3, "round_deadline_s": 600}
    study_id = admin.post("/api/v1/studies", json={"name": "dashboard check", "config": config}).json()["id"]
    for headers in sites.values():
        approve(admin, headers, study_id)
    assert admin.post(f"/api/v1/studies/{study_id}/start").status_code == 200
    for round_ in range(2):
        for i, headers in enumerate(sites.values()):
            stats = eval_stats(seed=10 * round_ + i).to_dict()
            task = admin.get("/api/v1/tasks/next", params={"wait": 10}, headers=headers).json()
            base = download(admin, task["global_model_url"], headers)
            scalars = local_eval(seed=10 * round_ + i, clinical=True)
            body = update_body(shifted(base, 0.01 * (i + 1)), 30 + 10 * i, eval_stats=stats, local_eval=scalars)
            response = admin.post(
                task["update_url"], content=body, headers={**headers, "Content-Type": "application/octet-stream"}
            )
            assert response.status_code == 201, response.text
    return study_id, sites


def test_dashboard_shows_the_api_numbers_in_a_real_browser(
    live_coordinator: LiveCoordinator, running_study: tuple[int, dict], tmp_path: Path
) -> None:
    study_id, _ = running_study
    admin = live_coordinator.client()
    viewer = admin.post("/api/v1/tokens", json={"role": "viewer", "label": "browser"}).json()["token"]
    url = f"{live_coordinator.url}/dashboard?study={study_id}#token={viewer}"

    dom = chromium("--virtual-time-budget=8000", "--dump-dom", url).stdout
    cells = Cells()
    cells.feed(dom)

    rounds = live_coordinator.client(viewer).get(f"/api/v1/studies/{study_id}/rounds").json()["data"]
    assert [r["status"] for r in sorted(rounds, key=lambda r: r["number"])] == ["completed", "completed", "open"]
    assert rounds[0]["pooled"]["eval"] is not None  # round 1's model was evaluated in round 2
    for r in rounds:
        shown = cells.rows.get((str(r["number"]), str(r["attempt"])))
        assert shown is not None, dom[dom.find('id="error"') :][:300]
        if r["status"] == "completed":
            glob = r["pooled"]["eval"]  # theta^g_t, known once the sites evaluated it in round t+1
            assert shown["global-f1"] == (f"{glob['micro_f1']:.3f}" if glob else "–")
            assert shown["global-map"] == (f"{glob['map']:.3f}" if glob else "–")
            assert shown["global-auroc"] == (auroc(glob) if glob else "–")
            assert shown["train-loss"] == f"{r['pooled']['train_loss']:.3f}"
            assert shown["reported"].startswith("2/2")
        else:
            assert shown["reported"].startswith("0/2")
    # the macro-AUROC chart: each site's personalised model, and theta^g_1 pooled with its interval as a bar
    chart = dom[dom.index("<figcaption>macro-AUROC") : dom.index('id="chart-auroc-values"')]
    values = dom[dom.index('id="chart-auroc-values"') :].split("</table>")[0]
    first = next(r for r in rounds if r["number"] == 1)
    assert "hidden" not in dom[: dom.index("<figcaption>macro-AUROC")].rsplit("<figure", 1)[1]
    assert chart.count("h6M") == 1  # one global point so far (theta^g_1), one interval bar
    assert f"<td>{auroc(first['pooled']['eval'])}</td>" in values
    for update in first["updates"]:
        assert f"<td>{update['local_eval']['macro_auroc']:.3f}</td>" in values
    assert sorted(cells.sites) == ["lyon", "oslo"]
    assert cells.approvals == {"lyon": "approved", "oslo": "approved"}
    assert cells.text.get("study-status") == "running"
    assert "cdn" not in dom.lower() and not re.search(r'src="https?://', dom)

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    chromium("--virtual-time-budget=8000", "--window-size=1400,1100", f"--screenshot={shot}", url)
    assert shot.stat().st_size > 10_000


def test_dashboard_is_accessible_and_refreshes_in_place(
    live_coordinator: LiveCoordinator, running_study: tuple[int, dict]
) -> None:
    study_id, sites = running_study
    admin = live_coordinator.client()
    config = {"model": {"preset": "tiny", "heads": "6:2"}, "sites": list(sites), "rounds": 2}
    draft = admin.post("/api/v1/studies", json={"name": "second study", "config": config})
    assert draft.status_code == 201, draft.text
    draft_id = draft.json()["id"]
    viewer = admin.post("/api/v1/tokens", json={"role": "viewer", "label": "axe"}).json()["token"]
    url = f"{live_coordinator.url}/dashboard?study={study_id}#token={viewer}"
    chromium_path, node = chromium_or_skip(), node_checks_or_skip()

    run = subprocess.run(
        [node, "dashboard_checks.mjs", chromium_path, url], cwd=AXE_DIR, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-3000:]
    checks = json.loads(run.stdout)
    violations = checks["violations"] + checks["narrow"]["violations"] + checks["loginViolations"]
    shown = json.dumps(violations, indent=1)
    assert not [v for v in violations if v["impact"] in ("serious", "critical")], shown
    assert checks["pageErrors"] == []
    assert checks["narrow"]["pageWidth"] <= 360  # 360 px wide: only the wide tables scroll, in their own box

    # a refresh kept every row element of every table
    refresh = checks["refresh"]
    assert refresh["marked"]["#rounds-table"] == 3 and refresh["marked"]["#sites-table"] == 2
    assert refresh["kept"] == refresh["marked"], refresh

    # hidden tab: no request for longer than the 3 s interval; visible again: one at once
    hidden = checks["hidden"]
    assert hidden["fetchesWhileHidden"] == 0, hidden
    assert hidden["msToFirstFetchWhenVisible"] is not None and hidden["msToFirstFetchWhenVisible"] < 300, hidden

    # the newest study's row is the first Tab stop; Enter selects it, and the next refresh keeps focus and selection
    keyboard = checks["keyboard"]
    assert keyboard["tabs"] == 1 and keyboard["focused"] == str(draft_id), keyboard
    for state in (keyboard["afterEnter"], keyboard["afterRefresh"]):
        assert state["focused"] == str(draft_id) and state["focusedIsMarked"], keyboard
        assert state["selected"] == [str(draft_id)] and state["search"] == f"?study={draft_id}", keyboard
        assert state["focusVisible"] and state["outline"] != "none", keyboard
    assert f"(#{draft_id})" in keyboard["afterRefresh"]["roundsOf"]
    # ArrowDown moves to the running study's row and Space selects it, without scrolling the page
    space = keyboard["afterSpace"]
    assert space["below"] == str(study_id) and space["focused"] == str(study_id), keyboard
    assert space["selected"] == [str(study_id)] and not space["scrolled"], keyboard


def test_viewer_reads_but_cannot_change_anything(
    live_coordinator: LiveCoordinator, running_study: tuple[int, dict]
) -> None:
    study_id, _ = running_study
    viewer_token = live_coordinator.client().post("/api/v1/tokens", json={"role": "viewer"}).json()["token"]
    viewer = live_coordinator.client(viewer_token)
    assert viewer.get("/api/v1/status").status_code == 200
    assert viewer.get(f"/api/v1/studies/{study_id}/rounds").status_code == 200
    for method, path in [
        ("POST", f"/api/v1/studies/{study_id}/pause"),
        ("POST", f"/api/v1/studies/{study_id}/cancel"),
        ("POST", "/api/v1/sites"),
        ("POST", "/api/v1/tokens"),
    ]:
        assert viewer.request(method, path, json={}).status_code == 403
    page = httpx.get(f"{live_coordinator.url}/dashboard")  # no token needed
    assert page.status_code == 200 and "cardiofl" in page.text  # the page itself holds no data


def test_metrics_in_prometheus_format(live_coordinator: LiveCoordinator, running_study: tuple[int, dict]) -> None:
    viewer_token = live_coordinator.client().post("/api/v1/tokens", json={"role": "viewer"}).json()["token"]
    assert httpx.get(f"{live_coordinator.url}/metrics").status_code == 401
    text = live_coordinator.client(viewer_token).get("/metrics").text
    assert 'cardiofl_rounds{status="completed"} 2.0' in text
    assert 'cardiofl_rounds{status="open"} 1.0' in text
    assert "cardiofl_uploads_total 4.0" in text
    assert re.search(r"cardiofl_upload_bytes_total [1-9]", text)
    assert "cardiofl_aggregation_seconds_count 2.0" in text
    assert re.search(r'cardiofl_site_last_seen_timestamp_seconds\{site="lyon"\} 1\.\d+e\+09', text)
    assert 'cardiofl_studies{status="running"} 1.0' in text
