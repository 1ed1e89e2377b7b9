"""What a site reports of its evaluations: exact per-site scalars, and pooled statistics only of enough records."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, f1_score

from shared.evaluation.metrics import EvalStats
from shared.model.network import build_model
from shared.study.rules import initial_state, study_exchange
from shared.terms import PrivacyConfig, StudyTerms
from site_agent.data.loader import SiteData
from site_agent.local_round import LocalRoundResult, LocalRoundSpec, evaluate, run_local_evaluation, run_local_round
from tests.site_agent.algorithms.conftest import RUNTIME, make_site, study

N_TEST = 30


@pytest.fixture(scope="module")
def site() -> SiteData:
    data = make_site(4, n_train=16, n_test=N_TEST)
    data.test.labels[:, 3] = 0.0  # a class absent from the test split
    return data


def _spec(config: StudyTerms, min_records: int, round_: int = 1) -> LocalRoundSpec:
    return LocalRoundSpec.of(
        config.model_copy(update={"privacy": PrivacyConfig(min_records=min_records)}), "lyon", round_
    )


def _round(config: StudyTerms, site: SiteData, min_records: int) -> LocalRoundResult:
    theta, phi = initial_state(config)
    return run_local_round(
        _spec(config, min_records),
        study_exchange(config).partition,
        global_tensors=theta,
        local_tensors=phi,
        initial_local=phi,
        data=site,
        runtime=RUNTIME,
    )


def test_the_personalised_model_is_reported_exactly_as_scikit_learn_scores_it(site: SiteData) -> None:
    config = study()
    result = _round(config, site, min_records=20)
    model = build_model(config.model.config(), seed=config.seed)
    model.load_state_dict({**result.shared, **result.local})  # FedAvg's personalised model: theta_k with phi_k
    predictions = evaluate(model, site.test, RUNTIME)
    truth, scores = predictions.truth.astype(int), predictions.scores
    with warnings.catch_warnings():  # classes without positives score 0 (scikit-learn >= 1.4) and warn
        warnings.simplefilter("ignore")
        ap = average_precision_score(truth, scores, average=None)
    present = truth.sum(axis=0) > 0
    assert not present.all()  # an absent class, which must count as 0 in mAP
    reported = result.meta.metrics.local_eval
    assert reported is not None and reported.n_samples == N_TEST
    assert reported.map == pytest.approx(ap.mean(), abs=1e-12)
    assert reported.map_present == pytest.approx(ap[present].mean(), abs=1e-12)
    assert reported.micro_f1 == pytest.approx(f1_score(truth, (scores >= 0.5).astype(int), average="micro"))
    assert reported.map != EvalStats.from_predictions(truth, scores).summary()["map"]  # not the histogram estimate


@pytest.mark.parametrize(("min_records", "pooled"), [(N_TEST, True), (N_TEST + 1, False)])
def test_pooled_statistics_leave_only_from_enough_test_records(site: SiteData, min_records: int, pooled: bool) -> None:
    config = study()
    result = _round(config, site, min_records)
    contribution = result.meta.metrics.eval_stats
    if pooled:
        assert contribution is not None and contribution["n_samples"] == N_TEST
        assert np.array(contribution["pos_hist"]).shape[0] == 20
    else:
        assert contribution == {"too_few_records": True}
    wire = result.meta.model_dump(mode="json")["metrics"]
    assert ("pos_hist" in str(wire)) is pooled  # nothing else carries histograms
    local = result.meta.metrics.local_eval
    assert local is not None  # FedCVD's scalars are sent either way; the clinical figures only of enough records
    clinical = {"macro_auroc", "macro_auroc_low", "sensitivity", "ece_high", "auroc_classes"}
    assert clinical <= local.model_fields_set if pooled else not clinical & local.model_fields_set
    if pooled:
        assert local.macro_auroc_low is not None and local.macro_auroc_high is not None
        assert local.macro_auroc_low <= local.macro_auroc <= local.macro_auroc_high  # type: ignore[operator]


def test_the_final_evaluation_sends_the_marker_below_the_minimum(site: SiteData) -> None:
    config = study()
    theta, phi = initial_state(config)
    result = run_local_evaluation(
        _spec(config, N_TEST + 1, round_=config.rounds + 1),
        global_tensors=theta,
        local_tensors=phi,
        initial_local=phi,
        data=site,
        runtime=RUNTIME,
    )
    metrics = result.meta.metrics
    assert metrics.eval_stats == {"too_few_records": True}
    assert metrics.local_eval is not None and metrics.local_eval.n_samples == N_TEST
    assert metrics.loss > 0  # the global model's mean loss, a scalar
