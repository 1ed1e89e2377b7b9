"""The dashboard's survey, external-validation and evaluation panels in a real headless Chromium.

The page is the coordinator's own (coordinator/static/dashboard.html); the API it reads is a stand-in on
127.0.0.1 that answers each read with the wire models of tests/cardiofl/job_results.py, whose counts and
figures are known, so every cell is checked against a value written out here.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files

import pytest
from pydantic import BaseModel

from shared.terms import StudyTerms
from shared.wire.api import Page, RoundPublic, SiteStatus, StatusReport, StudyPublic, TransferProgress, UpdatePublic
from shared.wire.jobs import ExternalResults
from shared.wire.protocol import EvalSummary
from tests.cardiofl.job_results import (
    EVALUATE,
    SURVEY,
    TRAIN,
    answers,
    evaluation_results,
    external_results,
    study,
    train_round,
)
from tests.e2e.test_dashboard import AXE_DIR, chromium, chromium_or_skip, node_checks_or_skip

PAGE = files("coordinator").joinpath("static/dashboard.html").read_text(encoding="utf-8")
LYON_HELD = {"bytes_done": 460_000_000, "bytes_total": 1_024_000_000}  # upload sessions under way
OSLO_HELD = {"bytes_done": 0, "bytes_total": 25_000_000_000}
RIGA_SENT = {"bytes_done": 47_000_000, "bytes_total": 94_000_000}  # theta^g_2 on its way to riga


@pytest.fixture()
def stand_in() -> Iterator[str]:
    """The base URL of a server that serves the dashboard and answers its reads of the three studies."""
    known = {path: model.model_dump_json() for path, model in answers().items()}
    sites = [SiteStatus(name=name, last_seen_at=None, current_task=None) for name in ("graz", "lyon", "oslo", "riga")]
    sites[1].current_task = {"study_id": TRAIN, "round": 3, "round_id": 7}  # lyon uploads its update of round 3
    sites[1].transfers = [TransferProgress(study_id=TRAIN, round=3, round_id=7, direction="upload", **LYON_HELD)]
    sites[2].transfers = [TransferProgress(study_id=EVALUATE, round=1, round_id=9, direction="upload", **OSLO_HELD)]
    sites[3].current_task = {"study_id": TRAIN, "round": 3, "round_id": 7}
    sites[3].transfers = [TransferProgress(study_id=TRAIN, round=3, round_id=7, direction="download", **RIGA_SENT)]
    known["/api/v1/status"] = StatusReport(time=datetime.now(UTC), studies=[], rounds={}, sites=sites).model_dump_json()

    with serving(known) as base:
        yield base


@contextmanager
def serving(known: dict[str, str]) -> Iterator[str]:
    """The base URL of a server on 127.0.0.1 that serves the dashboard and answers the reads in `known`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/dashboard":
                self._send(200, "text/html; charset=utf-8", PAGE)
            elif path in known:
                self._send(200, "application/json", known[path])
            else:
                self._send(404, "application/json", json.dumps({"error": {"code": "not_found", "message": path}}))

        def _send(self, status: int, content_type: str, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (the base class's name)
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


class Panels(HTMLParser):
    """The cell texts of each row of the panels' tables, and which sections are hidden."""

    TABLES = ("survey-table", "external-table", "evaluation-table", "sites-table", "buffer-table", "rounds-table")

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[list[str]]] = {table: [] for table in self.TABLES}
        self.hidden: dict[str, bool] = {}
        self._table: str | None = None
        self._body = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("id"):
            self.hidden[a["id"] or ""] = "hidden" in a
        if tag == "table" and a.get("id") in self.TABLES:
            self._table = a["id"]
        if tag == "tbody" and self._table:
            self._body = True
        if tag == "tr" and self._table and self._body:
            self.rows[self._table].append([])
        if tag in ("td", "th") and self._table and self._body:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table:
            self.rows[self._table][-1].append("".join(self._cell))
            self._cell = None
        if tag == "tbody":
            self._body = False
        if tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def shown(base: str, study_id: int) -> Panels:
    dom = chromium("--virtual-time-budget=8000", "--dump-dom", f"{base}/dashboard?study={study_id}#token=viewer").stdout
    panels = Panels()
    panels.feed(dom)
    return panels


def figures(summary: EvalSummary) -> list[str]:
    """Records, macro-AUROC with its interval, micro-F1 and mAP, as the CLI writes them."""
    auroc = f"{summary.macro_auroc:.3f} ({summary.macro_auroc_low:.3f}–{summary.macro_auroc_high:.3f})"
    return [str(summary.n_samples), auroc, f"{summary.micro_f1:.3f}", f"{summary.map:.3f}"]


def test_each_panel_shows_its_kind_of_study_with_the_apis_values(stand_in: str) -> None:
    survey = shown(stand_in, SURVEY)
    assert survey.hidden["survey-panel"] is False
    assert survey.hidden["external-panel"] and survey.hidden["evaluation-panel"]
    rows = {(row[0], row[1]): row[2:] for row in survey.rows["survey-table"]}
    assert len(rows) == 1 + 20 + 14 + 7 + 5 + 6 + 6 + 3 + 12  # records, then every key of every table, once
    # all groups pooled, as `cardiofl study survey` without --group: lyon's 7 excluded records are hidden
    assert rows[("records", "records")] == ["≥160", "122", "≥282"]
    assert rows[("labels", "NORM")] == ["≥80", "≥40", "≥120"]
    assert rows[("labels", "AFIB")] == ["≥15", "≥32", "≥47"]
    assert rows[("labels", "LVH")] == ["–", "–", "–"]
    assert rows[("quality", "flat_lead")] == ["≥12", "0", "≥12"]
    assert rows[("reason", "unreadable")] == ["–", "12", "≥12"]

    external = shown(stand_in, TRAIN)
    assert external.hidden["external-panel"] is False and external.hidden["survey-panel"]
    graz2, riga2, graz4 = (r.evaluation for r in external_results().results)
    at = "2026-05-01 12:00:00"
    assert external.rows["external-table"] == [
        ["2", "graz", *figures(graz2), at],
        ["2", "riga", *figures(riga2), at],
        ["4 (final)", "graz", *figures(graz4), at],
        ["4 (final)", "riga", "awaiting", "–", "–", "–", "–"],
    ]

    evaluation = shown(stand_in, EVALUATE)
    assert evaluation.hidden["evaluation-panel"] is False and evaluation.hidden["external-panel"]
    lyon, oslo = evaluation_results().results
    assert lyon.adapted is not None
    assert evaluation.rows["evaluation-table"] == [
        ["lyon", "as released", *figures(lyon.evaluation), at],
        ["lyon", "adapted on 120 records", *figures(lyon.adapted), at],
        ["oslo", "as released", *figures(oslo.evaluation), at],
        ["riga", "awaiting", "–", "–", "–", "–", "–"],
    ]


def test_a_transfer_under_way_shows_in_its_sites_row_and_nothing_where_none_is(stand_in: str) -> None:
    sites = {row[0]: row[3] for row in shown(stand_in, TRAIN).rows["sites-table"]}
    assert sites == {
        "graz": "–",
        "lyon": f"study {TRAIN} · round 3 · uploading 44% (460 of 1024 MB)",  # the bytes held of the update's size
        "oslo": f"study {EVALUATE} · round 1: uploading 0% (0.0 of 25.0 GB)",  # named: not a task of its own
        "riga": f"study {TRAIN} · round 3 · downloading 50% (47 of 94 MB)",  # the bytes sent of the model's size
    }


def test_the_panels_are_accessible_and_the_survey_pools_the_picked_group(stand_in: str) -> None:
    chromium_path, node = chromium_or_skip(), node_checks_or_skip()
    urls = [f"{stand_in}/dashboard?study={study_id}#token=viewer" for study_id in (SURVEY, TRAIN, EVALUATE)]
    run = subprocess.run(
        [node, "panels_checks.mjs", chromium_path, *urls], cwd=AXE_DIR, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    checks = json.loads(run.stdout)
    for page in checks["pages"]:
        serious = [v for v in page["violations"] if v["impact"] in ("serious", "critical")]
        assert not serious, json.dumps(serious, indent=1)
        assert page["pageErrors"] == []
    for rows in (checks["surveyTest"], checks["surveyTestAfterRefresh"]):  # the picked group stays picked
        by_key = {(row[0], row[1]): row[2:] for row in rows}
        assert by_key[("records", "records")] == ["40", "30", "70"]  # the test group alone
        assert by_key[("labels", "AFIB")] == ["–", "12", "≥12"]  # lyon's 3 hidden; oslo's 12 shown
        assert ("reason", "unreadable") not in by_key  # only excluded records have a reason
    assert "groups: test" in checks["surveyLegend"] and "awaiting: riga" in checks["surveyLegend"]


BUFFERED = 5  # a buffered study of three sites: M = 2, over 2 hours


def _buffered_answers() -> dict[str, str]:
    """A buffered study's reads: two releases, riga's late update in the second with staleness 2."""
    sites = ["lyon", "oslo", "riga"]
    terms = StudyTerms(sites=sites, rounds=4, min_sites=2, buffered={"buffer_size": 2})
    public = study(TRAIN).model_copy(update={"id": BUFFERED, "name": "fedbuff", "config": terms, "status": "running"})
    start = datetime(2026, 5, 1, 10, tzinfo=UTC)

    def update(site: str, base: int, staleness: int) -> dict[str, object]:
        return {"site": site, "num_examples": 10, "sha256": "2" * 64, "size": 100, "weight": 0.5, "train_seconds": 1.0,
                "received_at": start, "train_loss": 0.5, "eval": None, "local_eval": None, "base_round": base,
                "staleness": staleness}  # fmt: skip

    def released(number: int, hours: int, updates: list[dict[str, object]]) -> RoundPublic:
        return train_round(number).model_copy(
            update={"study_id": BUFFERED, "opened_at": start, "closed_at": start + timedelta(hours=hours),
                    "participants": dict.fromkeys(sites, 1.0), "updates": [UpdatePublic(**u) for u in updates]}
        )  # fmt: skip

    rounds = [
        released(1, 1, [update("lyon", 0, 0), update("oslo", 0, 0)]),
        released(3, 2, [update("lyon", 2, 0), update("riga", 0, 2)]),  # riga trained from version 0
    ]
    status = StatusReport(time=datetime.now(UTC), studies=[], rounds={}, sites=[])
    models: dict[str, BaseModel] = {
        "/api/v1/studies": Page[StudyPublic](data=[public], count=1),
        f"/api/v1/studies/{BUFFERED}": public,
        f"/api/v1/studies/{BUFFERED}/rounds": Page[RoundPublic](data=rounds, count=len(rounds)),
        f"/api/v1/studies/{BUFFERED}/external": ExternalResults(
            study_id=BUFFERED, validation_sites=[], every=1, results=[]
        ),
        "/api/v1/status": status,
    }
    return {path: model.model_dump_json() for path, model in models.items()}


def test_a_buffered_study_shows_each_sites_updates_rate_and_staleness() -> None:
    chromium_or_skip()
    with serving(_buffered_answers()) as base:
        panels = shown(base, BUFFERED)
    assert panels.hidden["buffer-panel"] is False
    assert panels.rows["buffer-table"] == [  # over the 2 hours from the first round's opening to the last release
        ["lyon", "2", "1.0", "0", "0.00", "0"],
        ["oslo", "1", "0.5", "0", "0.00", "0"],
        ["riga", "1", "0.5", "2", "2.00", "2"],
    ]
    reported = [row[3] for row in panels.rows["rounds-table"]]
    assert reported == ["2/3 · lyon, oslo", "2/3 · lyon, riga (τ 2)"]


def test_a_synchronous_study_hides_the_buffer_panel(stand_in: str) -> None:
    assert shown(stand_in, TRAIN).hidden["buffer-panel"] is True
