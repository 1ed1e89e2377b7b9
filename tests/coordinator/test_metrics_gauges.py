"""Per-study gauges at /metrics: equal to what the REST API reports, bounded in cost, and charted by the dashboard."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from sqlalchemy import event, update
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import utc_now
from coordinator.main import create_app
from coordinator.models import Site, Study
from coordinator.studies.gauges import FINISHED_SHOWN_FOR, LIVE_WITHIN
from site_agent.data import SiteData
from site_agent.worker import SiteWorker
from tests.conftest import coordinator_settings_for, create_tables
from tests.coordinator.factories import (
    ADMIN,
    approve,
    create_study,
    enrol,
    eval_stats,
    evaluate_and_upload,
    train_and_upload,
)
from tests.site_agent.test_agent import SITES, make_worker, site_data

__all__ = ["site_data"]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
TRAINING = {"optimizer": "sgd", "lr": 0.05, "batch_size": 8, "max_steps": 2}
DP = {"noise_multiplier": 1.1, "clip_norm": 0.05, "delta": 1e-5, "epsilon_budget": 1000.0}
POOLED = {"min_records": 1}  # the synthetic sites' test splits are small: pool them all the same
INFO = "cardiofl_study_info"


# -- reading both sides --------------------------------------------------------------------------------


def scrape(client: TestClient) -> list[Sample]:
    """Every sample of one /metrics scrape, parsed as Prometheus parses it."""
    response = client.get("/metrics", headers=ADMIN)
    assert response.status_code == 200, response.text
    return [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]


def gauges_of(samples: list[Sample], study_id: int) -> dict[str, float]:
    """The study's per-study samples (but the info gauge), by metric name."""
    return {s.name: s.value for s in samples if s.labels.get("study_id") == str(study_id) and s.name != INFO}


def api_figures(client: TestClient, study_id: int) -> dict[str, float]:
    """What the gauges must read, from GET /studies/{id}, /studies/{id}/rounds and /status."""
    study = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()
    rounds = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    sites = client.get("/api/v1/status", headers=ADMIN).json()["sites"]
    since = utc_now() - LIVE_WITHIN
    seen = {s["name"] for s in sites if s["last_seen_at"] and datetime.fromisoformat(s["last_seen_at"]) >= since}
    figures: dict[str, float] = {
        "cardiofl_study_rounds_planned": study["config"]["rounds"],
        "cardiofl_study_rounds_completed": study["completed_rounds"],
        "cardiofl_study_sites": len(study["approvals"]),
        "cardiofl_study_sites_approved": sum(state == "approved" for state in study["approvals"].values()),
        "cardiofl_study_sites_live": len(seen & set(study["approvals"])),
    }
    if study["current_round"] is not None:
        figures["cardiofl_study_current_round"] = study["current_round"]
    readings = [r for r in rounds if r["pooled"] is not None and r["pooled"].get("eval") is not None]
    if readings:
        latest = max(readings, key=lambda r: r["number"])
        figures["cardiofl_study_global_eval_round"] = latest["number"]
        for key in ("micro_f1", "map"):
            if latest["pooled"]["eval"].get(key) is not None:
                figures[f"cardiofl_study_global_{key}"] = latest["pooled"]["eval"][key]
    if study["privacy"] is not None:
        figures["cardiofl_study_dp_epsilon"] = study["privacy"]["epsilon"]
        if study["privacy"].get("epsilon_budget") is not None:
            figures["cardiofl_study_dp_epsilon_budget"] = study["privacy"]["epsilon_budget"]
    return figures


def assert_gauges_match_api(client: TestClient, study_id: int) -> dict[str, float]:
    """The study's gauges equal the API's figures, and its info gauge names its status; the gauges."""
    samples = scrape(client)
    gauges = gauges_of(samples, study_id)
    assert gauges == api_figures(client, study_id)
    status = client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"]
    assert [s.labels["status"] for s in samples if s.name == INFO and s.labels["study_id"] == str(study_id)] == [status]
    return gauges


# -- studies run by real agents ------------------------------------------------------------------------


def workers_for(client: TestClient, data: dict[str, SiteData], root: Path) -> dict[str, SiteWorker]:
    """An agent per site of SITES, enrolled at `client`, approving every study it is offered."""
    return {
        name: make_worker(client, name, enrol(client, name), root / name, b"k" * 32, data[name])[0] for name in SITES
    }


def start(client: TestClient, study_id: int) -> None:
    response = client.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN)
    assert response.status_code == 200, response.text


def poll_all(workers: dict[str, SiteWorker]) -> None:
    for worker in workers.values():
        assert worker.poll_once()


def test_study_gauges_follow_the_api_through_a_study(
    client: TestClient, sessions: sessionmaker[Session], site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    workers = workers_for(client, site_data, tmp_path)
    study_id = create_study(client, list(SITES), rounds=2, training=TRAINING, seed=11, privacy=POOLED)
    draft = assert_gauges_match_api(client, study_id)  # no round yet: nothing breaks, nothing is made up
    assert draft["cardiofl_study_rounds_completed"] == 0 and "cardiofl_study_current_round" not in draft
    assert draft["cardiofl_study_sites_approved"] == 0 and "cardiofl_study_global_micro_f1" not in draft
    start(client, study_id)
    assert assert_gauges_match_api(client, study_id)["cardiofl_study_current_round"] == 1
    poll_all(workers)  # round 1 completes; round 2 opens, where the sites will report theta^g_1
    first = assert_gauges_match_api(client, study_id)
    assert first["cardiofl_study_rounds_completed"] == 1 and first["cardiofl_study_current_round"] == 2
    assert first["cardiofl_study_sites_approved"] == 2 and first["cardiofl_study_sites_live"] == 2
    poll_all(workers)  # round 2 completes with the sites' reading of theta^g_1; the final evaluation opens
    second = assert_gauges_match_api(client, study_id)
    assert second["cardiofl_study_global_eval_round"] == 1 and 0 <= second["cardiofl_study_global_micro_f1"] <= 1
    poll_all(workers)  # the final evaluation reports theta^g_2
    done = assert_gauges_match_api(client, study_id)
    assert client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed"
    assert done["cardiofl_study_global_eval_round"] == 2 and "cardiofl_study_current_round" not in done
    assert not any(name.startswith("cardiofl_study_dp_") for name in done)  # no DP: no epsilon
    with sessions.begin() as session:  # oslo's agent went quiet three minutes ago
        stale = utc_now() - LIVE_WITHIN - timedelta(minutes=1)
        session.execute(update(Site).where(Site.name == "oslo").values(last_seen_at=stale))
    assert assert_gauges_match_api(client, study_id)["cardiofl_study_sites_live"] == 1


@pytest.fixture(scope="module")
def coordinator_that_ran_studies(
    tmp_path_factory: pytest.TempPathFactory, site_data: dict[str, SiteData]
) -> Iterator[tuple[TestClient, int, int]]:
    """(coordinator, a finished DP study, a running plain study with round 1 open) on SQLite, real agents."""
    root = tmp_path_factory.mktemp("ran")
    url = f"sqlite:///{root / 'coordinator.db'}"
    create_tables(url)
    with TestClient(create_app(coordinator_settings_for(url))) as client:
        workers = workers_for(client, site_data, root)
        dp_id = create_study(
            client,
            list(SITES),
            rounds=2,
            training=TRAINING,
            seed=3,
            aggregation={"name": "equal"},
            min_sites=2,
            privacy={**POOLED, "dp": DP},
        )
        start(client, dp_id)
        for _ in range(3):  # two training rounds and the final evaluation
            poll_all(workers)
        assert client.get(f"/api/v1/studies/{dp_id}", headers=ADMIN).json()["status"] == "completed"
        plain_id = create_study(client, list(SITES), rounds=2, training=TRAINING, seed=5, privacy=POOLED)
        start(client, plain_id)
        yield client, dp_id, plain_id


def test_a_dp_studys_epsilon_is_the_apis(coordinator_that_ran_studies: tuple[TestClient, int, int]) -> None:
    client, dp_id, plain_id = coordinator_that_ran_studies
    dp = assert_gauges_match_api(client, dp_id)
    privacy = client.get(f"/api/v1/studies/{dp_id}", headers=ADMIN).json()["privacy"]
    assert dp["cardiofl_study_dp_epsilon"] == privacy["epsilon"] > 0 and privacy["rounds"] == 2
    assert dp["cardiofl_study_dp_epsilon_budget"] == DP["epsilon_budget"]
    plain = assert_gauges_match_api(client, plain_id)
    assert "cardiofl_study_dp_epsilon" not in plain and plain["cardiofl_study_current_round"] == 1


# -- the dashboard ---------------------------------------------------------------------------------------


def dashboard_exprs(panels: list[dict[str, Any]]) -> Iterator[str]:
    """Every PromQL expression of the panels' targets, rows' nested panels included."""
    for panel in panels:
        yield from dashboard_exprs(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield target["expr"]


def test_the_dashboard_charts_only_metrics_the_coordinator_exposes(
    coordinator_that_ran_studies: tuple[TestClient, int, int],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert re.fullmatch(r"label_values\(cardiofl_study_info, ?study\)", variables["study"]["query"]["query"])
    exprs = list(dashboard_exprs(dashboard["panels"]))
    used = {name for expr in exprs for name in re.findall(r"\bcardiofl_[a-z0-9_]+", expr)}
    used |= set(re.findall(r"\bcardiofl_[a-z0-9_]+", variables["study"]["query"]["query"]))
    client, _, _ = coordinator_that_ran_studies
    exposed = {sample.name for sample in scrape(client)}
    assert used and used <= exposed, used - exposed
    per_study = {name for name in exposed if name.startswith("cardiofl_study_")}
    assert per_study <= used, per_study - used  # every per-study gauge is charted
    assert all('study=~"$study"' in expr for expr in exprs if "cardiofl_study_" in expr)
    datasources = [p["datasource"] for p in dashboard["panels"] if "datasource" in p]
    assert datasources and all(d == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for d in datasources)


# -- the cost of a scrape --------------------------------------------------------------------------------


def run_study(client: TestClient, headers: dict[str, dict[str, str]], rounds: int) -> int:
    """A study of `rounds` rounds driven to its end through the API, each round's theta^g read by the sites."""
    study_id = create_study(client, list(headers), rounds=rounds)
    for site in headers.values():
        approve(client, site, study_id)
    start(client, study_id)
    for number in range(1, rounds + 1):
        for seed, site in enumerate(headers.values()):
            read = {"eval_stats": eval_stats(seed).to_dict()} if number > 1 else {}
            assert train_and_upload(client, site, 0.1, 10, **read).status_code == 201
    for seed, site in enumerate(headers.values()):
        assert evaluate_and_upload(client, site, eval_stats=eval_stats(seed).to_dict()).status_code == 201
    assert client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed"
    return study_id


@contextmanager
def counted(client: TestClient) -> Iterator[list[str]]:
    """The SQL statements the app's engine runs meanwhile."""
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    engine = client.app.state.coordinator.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", count)


def statements_per_scrape(root: Path, studies: int, rounds: int) -> int:
    """SQL statements of one scrape of a coordinator that ran `studies` studies of `rounds` rounds each."""
    root.mkdir()
    url = f"sqlite:///{root / 'coordinator.db'}"
    create_tables(url)
    with TestClient(create_app(coordinator_settings_for(url))) as client:
        headers = {name: enrol(client, name) for name in SITES}
        ids = [run_study(client, headers, rounds) for _ in range(studies)]
        scrape(client)  # warm: what is read once per process (epsilon's accountant, cached terms) is read
        with counted(client) as statements:
            samples = scrape(client)
    for study_id in ids:
        assert gauges_of(samples, study_id)["cardiofl_study_global_eval_round"] == rounds
    return len(statements)


def test_a_scrape_costs_the_same_however_many_rounds_a_study_ran(tmp_path: Path) -> None:
    one, three = (statements_per_scrape(tmp_path / f"r{n}", studies=1, rounds=n) for n in (1, 3))
    assert one == three


def test_a_scrape_costs_a_fixed_number_of_statements_per_study(tmp_path: Path) -> None:
    one, two, three = (statements_per_scrape(tmp_path / f"s{n}", studies=n, rounds=1) for n in (1, 2, 3))
    per_study = two - one
    assert three - two == per_study and 0 < per_study <= 10


def test_finished_studies_leave_the_gauges_after_a_while(client: TestClient, sessions: sessionmaker[Session]) -> None:
    headers = {name: enrol(client, name) for name in SITES}
    old, recent = run_study(client, headers, 1), run_study(client, headers, 1)
    draft = create_study(client, list(SITES))
    with sessions.begin() as session:
        ended = utc_now() - FINISHED_SHOWN_FOR - timedelta(hours=1)
        session.execute(update(Study).where(Study.id.in_([old, draft])).values(updated_at=ended))
    shown = {s.labels["study_id"] for s in scrape(client) if s.name == INFO}
    assert shown == {str(recent), str(draft)}  # an open study stays, however old
