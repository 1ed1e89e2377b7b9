"""The typed metric views read what the coordinator stores and write it back byte for byte."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from shared.evaluation.metrics import EvalStats, exact_summary, site_contribution
from shared.evaluation.summaries import contribution_summary, pooled_summaries
from shared.study.accounting import privacy_report
from shared.terms import StudyTerms
from shared.wire.api import RoundPublic, UpdatePublic
from shared.wire.metrics import MetricSummary, PooledMetrics, PrivacySpent


def _site(seed: int, n: int, min_records: int = 5) -> dict[str, Any]:
    """One site's report as an agent sends it: its contribution and its personalised model's exact summary."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, 2, size=(n, 4))
    score = rng.random((n, 4))
    report = site_contribution(truth, score, 0.7 * n, min_records=min_records)
    return {"loss": 0.5 + seed, "eval_stats": report, "local_eval": exact_summary(truth, score, 0.6 * n)}


def _same_json(model: Any, stored: dict[str, Any]) -> None:
    assert json.loads(model.model_dump_json()) == json.loads(json.dumps(stored))


def test_pooled_figures_read_back_typed_and_write_back_as_stored() -> None:
    reports = [(12, _site(0, 12)), (3, _site(1, 3)), (20, _site(2, 20))]  # the second has too few records
    stored = {**pooled_summaries(reports, 4), "global_label": "theta^g with phi_0"}
    pooled = PooledMetrics.model_validate(stored)
    _same_json(pooled, stored)
    assert pooled.eval is not None and pooled.local_eval is not None and pooled.train_loss is not None
    assert (pooled.eval.n_sites, pooled.eval.n_sites_too_few, pooled.eval.n_samples) == (2, 1, 32)
    assert isinstance(pooled.eval.micro_f1, float) and pooled.eval.micro_f1 == stored["eval"]["micro_f1"]
    assert pooled.local_eval.n_samples == 35 and pooled.local_eval.map == stored["local_eval"]["map"]
    assert pooled.privacy is None and "privacy" not in pooled.model_dump()  # absent stays absent
    evaluation = PooledMetrics.model_validate(pooled_summaries(reports, 4, trained=False))
    assert evaluation.train_loss is None


def test_a_sites_marker_and_its_contribution_keep_their_keys() -> None:
    marker = contribution_summary(None)
    _same_json(MetricSummary.model_validate(marker), marker)
    assert MetricSummary.model_validate(marker).too_few_records is True
    rng = np.random.default_rng(3)
    stats = EvalStats.from_predictions(rng.integers(0, 2, size=(9, 4)), rng.random((9, 4)), loss_sum=3.0)
    summary = contribution_summary(stats)
    typed = MetricSummary.model_validate(summary)
    _same_json(typed, summary)
    assert typed.too_few_records is False and typed.n_samples == 9 and typed.n_sites is None


def test_epsilon_spent_reads_the_accountants_report() -> None:
    terms = StudyTerms.model_validate(
        {
            "model": {"preset": "tiny", "heads": "6:2"},
            "sites": ["a", "b"],
            "rounds": 3,
            "aggregation": {"name": "equal"},
            "privacy": {"dp": {"noise_multiplier": 1.0, "clip_norm": 0.1, "delta": 1e-5}},
        }
    )
    report = privacy_report(terms, 2)
    assert report is not None
    spent = PrivacySpent.model_validate(report)
    _same_json(spent, report)
    assert spent.epsilon == report["epsilon"] and spent.rounds == 2 and spent.delta == 1e-5
    assert spent.relation == report["relation"] and spent.mode == "central"


def test_a_newer_coordinators_extra_figure_passes_through_and_a_wrong_type_is_refused() -> None:
    stored = {"train_loss": 0.25, "eval": {"micro_f1": 0.5, "n_samples": 10, "auroc": 0.7}, "fairness": {"gap": 1}}
    pooled = PooledMetrics.model_validate(stored)
    _same_json(pooled, stored)
    assert pooled.eval is not None and pooled.eval.model_extra == {"auroc": 0.7}
    with pytest.raises(ValidationError, match="micro_f1"):
        MetricSummary.model_validate({"micro_f1": "high"})


def test_round_and_update_views_hold_typed_metrics() -> None:
    local = exact_summary(np.eye(4, dtype=int), np.full((4, 4), 0.6), 1.0)
    update = UpdatePublic.model_validate(
        {
            "site": "a",
            "num_examples": 4,
            "sha256": "0" * 64,
            "size": 1,
            "weight": None,
            "train_seconds": 0.1,
            "received_at": "2026-12-02T12:00:00",
            "train_loss": 0.3,
            "eval": None,
            "local_eval": local,
        }
    )
    assert isinstance(update.local_eval, MetricSummary) and update.local_eval.micro_f1 == local["micro_f1"]
    round_ = RoundPublic.model_validate(
        {
            "id": 1,
            "study_id": 1,
            "number": 1,
            "attempt": 1,
            "kind": "train",
            "status": "completed",
            "participants": {"a": 1.0},
            "opened_at": "2026-12-02T12:00:00",
            "deadline_at": "2026-12-02T12:10:00",
            "closed_at": None,
            "note": "",
            "base_sha256": "0" * 64,
            "base_size": 1,
            "global_model_sha256": None,
            "updates": [update.model_dump(mode="json")],
            "pooled": {"train_loss": 0.3, "local_eval": local},
        }
    )
    assert round_.pooled is not None and round_.pooled.local_eval == update.local_eval
    assert json.loads(round_.model_dump_json())["pooled"] == {"train_loss": 0.3, "local_eval": local}


def test_the_api_schema_documents_every_metric_field_in_both_directions() -> None:
    for mode in ("validation", "serialization"):
        schema = RoundPublic.model_json_schema(mode=mode)["$defs"]
        assert list(schema["PooledMetrics"]["properties"]) == list(PooledMetrics.model_fields), mode
        assert list(schema["MetricSummary"]["properties"]) == list(MetricSummary.model_fields), mode
        assert list(schema["PrivacySpent"]["properties"]) == list(PrivacySpent.model_fields), mode
