"""The model card: every figure the rounds API's, written as Markdown and HTML, on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from coordinator.db import utc_now
from coordinator.rounds.closing import tick
from coordinator.studies.card_render import card_html, card_markdown
from shared.evaluation.metrics import exact_summary
from shared.evaluation.summaries import site_summary
from shared.wire.card import ModelCard
from tests.coordinator.factories import (
    ADMIN,
    approve,
    create_study,
    eval_stats,
    evaluate_and_upload,
    issue,
    running_study,
    train_and_upload,
)

SITES = ("graz", "lyon", "oslo")  # graz has 10 test records, below the study's min_records of 20
RECORDS = {"graz": 10, "lyon": 60, "oslo": 40}
DP = {"noise_multiplier": 1.1, "clip_norm": 0.05, "delta": 1e-5}
STEP = 1e-5  # each "training" moves every weight by this: within the clipping norm of the tiny model
SHOWN = ("micro_f1", "map", "macro_auroc", "balanced_accuracy", "sensitivity", "specificity", "ece")


def own_model(seed: int, n_samples: int) -> dict[str, Any]:
    """A site's exact report of its own model: with the clinical figures and their intervals from 20 records."""
    rng = np.random.default_rng(seed)
    truth = rng.random((n_samples, 20)) < 0.3
    scores = np.clip(truth * 0.4 + rng.random((n_samples, 20)) * 0.6, 0, 1)
    if n_samples < 20:
        return exact_summary(truth, scores, loss_sum=0.7 * n_samples)
    return site_summary(truth, scores, 0.7 * n_samples, seed=seed)


def global_stats(site: str, seed: int) -> dict[str, Any]:
    """A site's counts and histograms of a global model, or the marker of too few records."""
    return {"too_few_records": True} if RECORDS[site] < 20 else eval_stats(seed, n_samples=RECORDS[site]).to_dict()


def _tick_after_deadline(client: TestClient) -> None:
    state = client.app.state.coordinator
    tick(state.sessions, now=utc_now() + timedelta(seconds=61), lease_s=state.settings.aggregation_lease_s)


def _get(client: TestClient, path: str, **params: Any) -> Any:
    response = client.get(path, params=params, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json() if response.headers["content-type"].startswith("application/json") else response.text


def run_study(client: TestClient) -> tuple[int, dict[str, dict[str, str]]]:
    """Two rounds over SITES, of which round 1's first attempt misses its quorum, then the final evaluation."""
    privacy = {"min_records": 20, "dp": DP}
    study_id, headers = running_study(
        client, sites=SITES, rounds=2, min_sites=2, round_retries=1, privacy=privacy, aggregation={"name": "equal"}
    )
    assert train_and_upload(client, headers["lyon"], STEP, 10).status_code == 201  # alone: round 1 fails
    _tick_after_deadline(client)
    for number, seed in ((1, 10), (2, 20)):
        for index, site in enumerate(SITES):
            reports: dict[str, Any] = {"local_eval": own_model(seed + index, RECORDS[site])}
            if number == 2:  # round 2's sites evaluate theta^g_1
                reports["eval_stats"] = global_stats(site, seed + index)
            assert train_and_upload(client, headers[site], STEP, RECORDS[site], **reports).status_code == 201
    for index, site in enumerate(SITES):  # the final evaluation of theta^g_2
        assert evaluate_and_upload(client, headers[site], eval_stats=global_stats(site, 30 + index)).status_code == 201
    return study_id, headers


def test_every_figure_on_the_card_is_the_rounds_apis(client: TestClient) -> None:
    study_id, _ = run_study(client)
    card = _get(client, f"/api/v1/studies/{study_id}/card")
    study = _get(client, f"/api/v1/studies/{study_id}")
    rounds = _get(client, f"/api/v1/studies/{study_id}/rounds")["data"]
    assert study["status"] == "completed"
    last = next(r for r in rounds if r["number"] == 2 and r["status"] == "completed")
    assert card["evaluated_round"] == 2 and card["final"] is True and card["global_label"] == "Global"
    by_site = {u["site"]: u for u in last["updates"]}
    assert [s["site"] for s in card["sites"]] == list(SITES)
    for site in card["sites"]:
        update = by_site[site["site"]]
        assert site["eval"] == update["eval"] and site["local_eval"] == update["local_eval"]
        assert site["num_examples"] == update["num_examples"] and site["reported"] is True
    assert card["pooled_eval"] == last["pooled"]["eval"] and card["pooled_local_eval"] == last["pooled"]["local_eval"]
    assert card["pooled_eval"]["macro_auroc_bound"] is not None and card["pooled_eval"]["n_sites_too_few"] == 1
    assert card["privacy"] == study["privacy"] and card["privacy"]["epsilon"] > 0
    assert card["privacy"]["relation"] == "replace-one"
    assert card["models"] == _get(client, f"/api/v1/studies/{study_id}/models")["data"]
    assert [m["sha256"] for m in card["models"][1:]] == [
        r["global_model_sha256"] for r in rounds if r["kind"] == "train" and r["status"] == "completed"
    ]
    canonical = json.dumps(study["config"], sort_keys=True, separators=(",", ":"))
    assert card["terms"] == study["config"] and card["terms_digest"] == hashlib.sha256(canonical.encode()).hexdigest()
    assert {a["site"]: a["state"] for a in card["approvals"]} == study["approvals"]
    assert all(a["current"] and a["digest"] == a["expected_digest"] for a in card["approvals"])
    assert [(p["role"], p["name"], p["identity"]) for p in card["plugins"]] == [
        ("model", "tiny", None),
        ("algorithm", "fedavg", None),
    ]
    # the reliability diagram of the pooled final evaluation gives the pooled ECE
    bins = card["reliability"]
    total = sum(b["count"] for b in bins)
    assert total == 20 * (RECORDS["lyon"] + RECORDS["oslo"])
    ece = sum(b["count"] * abs(b["observed"] - b["predicted"]) for b in bins if b["count"]) / total
    assert ece == pytest.approx(card["pooled_eval"]["ece"], abs=1e-12)


def test_the_limitations_name_the_site_below_min_records_and_the_round_that_missed_its_quorum(
    client: TestClient,
) -> None:
    study_id, _ = run_study(client)
    card = ModelCard.model_validate(_get(client, f"/api/v1/studies/{study_id}/card"))
    rounds = _get(client, f"/api/v1/studies/{study_id}/rounds")["data"]
    failed = next(r for r in rounds if r["status"] == "failed")
    assert [(x.kind, x.site, x.round, x.attempt) for x in card.limitations] == [
        ("too_few_records", "graz", None, None),
        ("quorum_missed", None, 1, 1),
    ]
    assert "graz has fewer test records (10)" in card.limitations[0].text
    assert failed["note"] in card.limitations[1].text and "quorum missed" in card.limitations[1].text
    text = card_markdown(card)
    assert card.limitations[0].text.replace("_", "\\_") in text and "failed: quorum missed" in text


def _shown(summary: dict[str, Any], key: str, bound: bool) -> str:
    """A figure as the card writes it: three decimals, ± its bound where pooled, its 95% interval."""
    text = f"{summary[key]:.3f}"
    if bound and summary.get(f"{key}_bound") is not None:
        text += f"±{summary[f'{key}_bound']:.3f}"
    if summary.get(f"{key}_low") is not None:
        text += f" (95% CI {summary[f'{key}_low']:.3f}–{summary[f'{key}_high']:.3f})"
    return text


def test_the_markdown_and_html_cards_show_the_apis_figures(client: TestClient) -> None:
    study_id, _ = run_study(client)
    card = _get(client, f"/api/v1/studies/{study_id}/card")
    markdown = _get(client, f"/api/v1/studies/{study_id}/card", format="md")
    page = client.get(f"/api/v1/studies/{study_id}/card", params={"format": "html"}, headers=ADMIN)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    html = page.text
    expected = [f"{card['privacy']['epsilon']:.3f}", card["terms_digest"], *(m["sha256"] for m in card["models"])]
    for key in SHOWN:
        expected.append(_shown(card["pooled_eval"], key, bound=True))
        expected.append(f"{card['pooled_local_eval'][key]:.3f}")
        for site in card["sites"]:
            if site["local_eval"].get(key) is not None:
                expected.append(_shown(site["local_eval"], key, bound=False))
            if not site["eval"].get("too_few_records"):
                expected.append(_shown(site["eval"], key, bound=True))
    auroc = _shown(card["pooled_eval"], "macro_auroc", bound=True)
    assert "±" in auroc and "(95% CI " in auroc  # the pooled macro-AUROC: its bound and its interval
    expected.append(f"{auroc}, {card['pooled_eval']['auroc_classes']} classes")  # and how many classes it averages
    for text in expected:
        assert text in markdown and text in html, text
    assert markdown.startswith("# Model card: trial\n") and "<svg" in html and "<svg" not in markdown
    for approval in card["approvals"]:
        assert approval["digest"] in markdown and approval["digest"] in html


def test_html_escapes_every_name(client: TestClient) -> None:
    hostile = '<script>alert("x")</script> & <b>bold</b>'
    running_study(client, sites=("lyon",), rounds=1)
    created = client.post(
        "/api/v1/studies",
        json={"name": hostile, "config": {"sites": ["lyon"], "model": {"preset": "tiny"}, "rounds": 1}},
        headers=ADMIN,
    )
    assert created.status_code == 201, created.text
    card = ModelCard.model_validate(_get(client, f"/api/v1/studies/{created.json()['id']}/card"))
    html = _get(client, f"/api/v1/studies/{card.study_id}/card", format="html")
    assert "<script>" not in html and "<b>" not in html and "&lt;script&gt;alert(&quot;x&quot;)" in html
    assert "\\<script\\>" in _get(client, f"/api/v1/studies/{card.study_id}/card", format="md")
    # a site name cannot hold markup (SiteName), but the renderer escapes whatever it is given
    site = '"><img src=x onerror=alert(1)>'
    forged = card.model_copy(update={"sites": [card.sites[0].model_copy(update={"site": site})]})
    assert "<img" not in card_html(forged) and "&quot;&gt;&lt;img src=x" in card_html(forged)


def test_a_viewer_reads_the_card_and_an_unknown_study_has_none(client: TestClient) -> None:
    study_id, _ = running_study(client, sites=("lyon",), rounds=1)
    viewer = issue(client, "viewer")
    for card_format in ("json", "md", "html"):
        response = client.get(f"/api/v1/studies/{study_id}/card", params={"format": card_format}, headers=viewer)
        assert response.status_code == 200, response.text
    card = ModelCard.model_validate(client.get(f"/api/v1/studies/{study_id}/card", headers=viewer).json())
    assert card.evaluated_round is None and card.pooled_eval is None and card.reliability is None
    assert [x.kind for x in card.limitations] == ["no_global_reading"]
    assert len(card.models) == 1  # theta^g_0
    missing = client.get("/api/v1/studies/999/card", headers=viewer)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    unknown_baseline = client.get(f"/api/v1/studies/{study_id}/card", params={"baseline": 999}, headers=viewer)
    assert unknown_baseline.status_code == 404
    wrong = client.get(f"/api/v1/studies/{study_id}/card", params={"format": "pdf"}, headers=viewer)
    assert wrong.status_code == 422


def test_a_local_baseline_shows_each_site_alone_beside_the_federated_figures(client: TestClient) -> None:
    study_id, headers = run_study(client)
    local_id = create_study(client, list(SITES), algorithm={"name": "local"}, rounds=1, privacy={"min_records": 20})
    for site in SITES:
        approve(client, headers[site], local_id)
    assert client.post(f"/api/v1/studies/{local_id}/start", headers=ADMIN).status_code == 200
    for index, site in enumerate(SITES):
        alone = own_model(50 + index, RECORDS[site])
        assert train_and_upload(client, headers[site], 0.0, RECORDS[site], local_eval=alone).status_code == 201
    local_round = _get(client, f"/api/v1/studies/{local_id}/rounds/1")
    assert local_round["status"] == "completed"
    card = _get(client, f"/api/v1/studies/{study_id}/card", baseline=local_id)
    assert card["baseline"] == {"study_id": local_id, "name": "trial", "status": "running", "round": 1}
    alone = {u["site"]: u["local_eval"] for u in local_round["updates"]}
    assert {s["site"]: s["baseline"] for s in card["sites"]} == alone
    markdown = _get(client, f"/api/v1/studies/{study_id}/card", format="md", baseline=local_id)
    assert "## Local baseline" in markdown
    assert _shown(alone["lyon"], "macro_auroc", bound=False) in markdown
    # the baseline must be a local study, and a local study says it is one
    refused = client.get(f"/api/v1/studies/{study_id}/card", params={"baseline": study_id}, headers=ADMIN)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "baseline_not_local"
    own = ModelCard.model_validate(_get(client, f"/api/v1/studies/{local_id}/card"))
    assert "local_only" in [x.kind for x in own.limitations]
    # ... of the same sites: a local study of fewer sites answers nobody's question here
    fewer = create_study(client, list(SITES)[:1], algorithm={"name": "local"}, rounds=1, privacy={"min_records": 20})
    other = client.get(f"/api/v1/studies/{study_id}/card", params={"baseline": fewer}, headers=ADMIN)
    assert other.status_code == 422 and other.json()["error"]["code"] == "baseline_not_comparable"
