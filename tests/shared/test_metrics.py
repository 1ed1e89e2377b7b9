import json
import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, f1_score

from shared.evaluation.metrics import (
    N_BINS,
    TOO_FEW_RECORDS,
    EvalStats,
    average_precision,
    exact_summary,
    mean_average_precision,
    micro_f1,
    parse_contribution,
    score_bins,
    site_contribution,
)
from shared.evaluation.summaries import contribution_summary, mean_summary, pooled_summary
from shared.model.network import build_model, preset


def sklearn_ap(y_true: np.ndarray, y_score: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # sklearn warns for classes without positives (AP = 0 since 1.4)
        warnings.simplefilter("ignore")
        return average_precision_score(y_true, y_score, average=None)


def sklearn_micro_f1(y_true: np.ndarray, y_score: np.ndarray) -> float:
    return f1_score(y_true, (y_score >= 0.5).astype(int), average="micro", zero_division=0)


def random_case(seed: int, n: int, n_classes: int = 20) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (rng.random((n, n_classes)) < rng.uniform(0.02, 0.3, n_classes)).astype(np.int64)
    y[:, 3] = 0  # an absent class
    logits = rng.normal(-1.0, 2.5, (n, n_classes)) + 3.0 * y * rng.random(n_classes)
    return y, 1.0 / (1.0 + np.exp(-logits))


def tiny_model_scores(seed: int, n: int) -> np.ndarray:
    config = preset("tiny", "6:2")
    model = build_model(config, seed=seed).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logits = model(torch.randn(n, config.n_leads, config.signal_len, generator=generator))
    return torch.sigmoid(logits).numpy()


def test_hand_computed_average_precision() -> None:
    y = np.array([[1], [0], [1], [0]])
    s = np.array([[0.9], [0.8], [0.7], [0.1]])
    assert average_precision(y, s)[0] == pytest.approx((1.0 + 2.0 / 3.0) / 2.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_metrics_equal_sklearn_on_random_data(seed: int) -> None:
    y, s = random_case(seed, n=300)
    np.testing.assert_allclose(average_precision(y, s), sklearn_ap(y, s), atol=1e-12)
    assert micro_f1(y, s) == pytest.approx(sklearn_micro_f1(y, s), abs=1e-12)
    assert average_precision(y, s)[3] == 0.0


def test_exact_average_precision_handles_tied_scores_like_sklearn() -> None:
    y, s = random_case(4, n=200)
    s = np.round(s, 1)  # heavy ties
    np.testing.assert_allclose(average_precision(y, s), sklearn_ap(y, s), atol=1e-12)


def test_mean_average_precision_counts_absent_classes_as_zero() -> None:
    y, s = random_case(5, n=200)
    ap = sklearn_ap(y, s)
    map_all, map_present = mean_average_precision(y, s)
    assert map_all == pytest.approx(ap.mean())
    assert map_present == pytest.approx(np.delete(ap, 3).mean())


@pytest.mark.parametrize("seed", [0, 1])
def test_site_stats_give_exact_micro_f1_and_ap_within_the_bound(seed: int) -> None:
    y, s = random_case(seed, n=400)
    stats = EvalStats.from_predictions(y, s, loss_sum=12.5)
    summary = stats.summary()
    assert summary["micro_f1"] == pytest.approx(sklearn_micro_f1(y, s), abs=1e-12)
    assert summary["loss"] == pytest.approx(12.5 / 400)
    assert summary["n_samples"] == 400
    reference = sklearn_ap(y, s)
    low, high = stats.ap_bounds()
    estimate = stats.average_precision()
    assert np.all(low <= reference + 1e-12) and np.all(reference <= high + 1e-12)
    assert np.all(np.abs(estimate - reference) <= high - low + 1e-12)
    assert estimate[3] == 0.0 and low[3] == 0.0 and high[3] == 0.0


def test_pooled_stats_match_sklearn_on_the_concatenated_sites() -> None:
    sites = [random_case(10 + k, n=n) for k, n in enumerate((150, 400, 60))]
    pooled = sum((EvalStats.from_predictions(y, s) for y, s in sites), EvalStats.empty())
    y = np.concatenate([y for y, _ in sites])
    s = np.concatenate([s for _, s in sites])
    assert pooled.n_samples == 610
    summary = pooled.summary()
    assert summary["micro_f1"] == pytest.approx(sklearn_micro_f1(y, s), abs=1e-12)
    reference = sklearn_ap(y, s)
    low, high = pooled.ap_bounds()
    assert np.all(np.abs(pooled.average_precision() - reference) <= high - low + 1e-12)
    assert abs(summary["map"] - reference.mean()) <= (high - low).mean() + 1e-12
    # On 610 samples with scores spread over several logit units the interval is narrow.
    assert (high - low).max() < 0.02
    assert abs(summary["map"] - reference.mean()) < 2e-3


def test_stats_of_tiny_model_outputs_match_sklearn() -> None:
    rng = np.random.default_rng(0)
    per_site = []
    for site in range(2):
        scores = tiny_model_scores(seed=site, n=24)
        labels = (rng.random(scores.shape) < 0.3).astype(np.int64)
        per_site.append((labels, scores))
        stats = EvalStats.from_predictions(labels, scores)
        assert stats.summary()["micro_f1"] == pytest.approx(sklearn_micro_f1(labels, scores), abs=1e-12)
        low, high = stats.ap_bounds()
        reference = sklearn_ap(labels, scores)
        assert np.all(low <= reference + 1e-12) and np.all(reference <= high + 1e-12)
    pooled = EvalStats.from_predictions(*per_site[0]) + EvalStats.from_predictions(*per_site[1])
    y = np.concatenate([p[0] for p in per_site])
    s = np.concatenate([p[1] for p in per_site])
    assert pooled.summary()["micro_f1"] == pytest.approx(sklearn_micro_f1(y, s), abs=1e-12)
    low, high = pooled.ap_bounds()
    assert np.all(np.abs(pooled.average_precision() - sklearn_ap(y, s)) <= high - low + 1e-12)


def test_bins_never_cross_the_threshold() -> None:
    below = np.nextafter(0.5, 0.0)
    bins = score_bins(np.array([0.0, 1e-30, below, 0.5, np.nextafter(0.5, 1.0), 1.0]))
    assert bins.tolist()[2:4] == [N_BINS // 2 - 1, N_BINS // 2]
    assert bins[0] == 0 and bins[-1] == N_BINS - 1
    assert np.all(np.diff(score_bins(np.linspace(0, 1, 10_001))) >= 0)


def test_dict_round_trip_is_json_and_exact() -> None:
    y, s = random_case(3, n=100)
    stats = EvalStats.from_predictions(y, s, loss_sum=3.25)
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["n_bins"] == N_BINS and len(data["pos_hist"][0]) == N_BINS
    back = EvalStats.from_dict(data)
    assert back.n_samples == 100 and back.loss_sum == 3.25
    for name in ("tp", "fp", "fn", "pos_hist", "neg_hist"):
        np.testing.assert_array_equal(getattr(back, name), getattr(stats, name))
        assert getattr(back, name).dtype == np.int64


def _valid() -> dict:
    y, s = random_case(6, n=30, n_classes=4)
    return EvalStats.from_predictions(y, s).to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(n_bins=10), "n_bins must be"),
        (lambda d: d.update(n_samples=-1), "n_samples must be a non-negative integer"),
        (lambda d: d.update(n_samples=True), "n_samples must be a non-negative integer"),
        (lambda d: d.update(loss_sum=float("nan")), "loss_sum must be a finite"),
        (lambda d: d.pop("fp"), "missing field 'fp'"),
        (lambda d: d.update(tp=[]), "tp must be a non-empty list"),
        (lambda d: d.update(fn=[0, 0, 0]), r"fn must have shape \(4,\)"),
        (lambda d: d["fp"].__setitem__(0, 1.5), "fp must hold integers only"),
        (lambda d: d["fp"].__setitem__(0, True), "fp must hold integers only"),
        (lambda d: d["pos_hist"][0].__setitem__(0, -1), "pos_hist must be non-negative"),
        (lambda d: d["neg_hist"].pop(), r"neg_hist must have shape \(4, 1000\)"),
        (lambda d: d["neg_hist"][1].__setitem__(0, d["neg_hist"][1][0] + 1), "count exactly n_samples"),
        (lambda d: d["tp"].__setitem__(1, d["tp"][1] + 1), "disagree with the score histograms"),
        (lambda d: d.update(tp="12"), "tp must be a non-empty list"),
    ],
)
def test_from_dict_refuses_bad_statistics(change, message: str) -> None:
    data = _valid()
    change(data)
    with pytest.raises(ValueError, match=message):
        EvalStats.from_dict(data)


def test_from_dict_refuses_non_objects() -> None:
    with pytest.raises(ValueError, match="expected a JSON object"):
        EvalStats.from_dict([1, 2])  # type: ignore[arg-type]


def test_pooling_needs_the_same_classes() -> None:
    with pytest.raises(ValueError, match="20 and 5 classes"):
        EvalStats.empty() + EvalStats.empty(5)


def test_empty_stats_summary_is_zero_or_undefined() -> None:
    summary = EvalStats.empty().summary()
    assert math.isnan(summary["loss"]) and math.isnan(summary["map_present"])
    assert summary["micro_f1"] == 0.0 and summary["map"] == 0.0 and summary["n_samples"] == 0.0


@pytest.mark.parametrize(
    ("y", "s", "message"),
    [
        (np.zeros((3, 2)), np.zeros((3, 3)), "must both be"),
        (np.full((3, 2), 2), np.zeros((3, 2)), "only 0 and 1"),
        (np.zeros((3, 2)), np.full((3, 2), 1.5), "probabilities in"),
        (np.zeros((3, 2)), np.full((3, 2), np.nan), "probabilities in"),
    ],
)
def test_bad_predictions_are_refused(y: np.ndarray, s: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalStats.from_predictions(y, s)
    with pytest.raises(ValueError, match=message):
        micro_f1(y, s)


@pytest.mark.parametrize(("seed", "n"), [(0, 7), (1, 25), (2, 300)])
def test_exact_summary_is_scikit_learn_on_the_site_s_scores(seed: int, n: int) -> None:
    y, s = random_case(seed, n)
    s[: n // 2, 0] = 0.25  # ties, which the histograms could not resolve
    summary = exact_summary(y, s, loss_sum=0.5 * n)
    ap = sklearn_ap(y, s)
    present = y.sum(axis=0) > 0
    assert summary["map"] == pytest.approx(ap.mean(), abs=1e-12)  # the absent class 3 scores 0
    assert summary["map_present"] == pytest.approx(ap[present].mean(), abs=1e-12)
    assert summary["micro_f1"] == pytest.approx(sklearn_micro_f1(y, s), abs=1e-12)
    assert summary["loss"] == pytest.approx(0.5) and summary["n_samples"] == n
    assert set(summary) == {"loss", "micro_f1", "map", "map_present", "n_samples"}  # scalars only


def test_exact_summary_without_positives_has_no_present_class_map() -> None:
    y = np.zeros((4, 20), dtype=np.int64)
    summary = exact_summary(y, np.full((4, 20), 0.3), loss_sum=1.0)
    assert summary["map"] == 0.0 and summary["map_present"] is None


def test_exact_site_map_differs_from_the_histogram_approximation_within_its_bound() -> None:
    y, s = random_case(5, 400)
    s = np.round(s, 1)  # coarse scores: many in one bin, so the histogram AP must approximate
    stats = EvalStats.from_predictions(y, s)
    exact = exact_summary(y, s, loss_sum=0.0)["map"]
    low, high = stats.ap_bounds()
    assert exact != stats.summary()["map"]
    assert low.mean() - 1e-12 <= exact <= high.mean() + 1e-12


def test_a_site_below_the_minimum_contributes_only_the_marker() -> None:
    y, s = random_case(3, 19)
    assert site_contribution(y, s, 4.0, min_records=20) == {TOO_FEW_RECORDS: True}
    counted = site_contribution(y, s, 4.0, min_records=19)
    assert counted == EvalStats.from_predictions(y, s, loss_sum=4.0).to_dict()
    assert parse_contribution({TOO_FEW_RECORDS: True}, min_records=20) is None


@pytest.mark.parametrize(
    "data",
    [
        {TOO_FEW_RECORDS: True, "n_samples": 12},
        {TOO_FEW_RECORDS: 1},
        {TOO_FEW_RECORDS: False},
    ],
)
def test_the_marker_carries_nothing_else(data: dict) -> None:
    with pytest.raises(ValueError, match="nothing else"):
        parse_contribution(data)


def test_counts_of_fewer_records_than_the_minimum_are_refused() -> None:
    data = EvalStats.from_predictions(*random_case(4, 12)).to_dict()
    with pytest.raises(ValueError, match="12 test records, below the study's privacy.min_records 20"):
        parse_contribution(data, min_records=20)
    assert parse_contribution(data, min_records=12).to_dict() == data  # type: ignore[union-attr]
    assert parse_contribution(data) is not None  # stored reports are re-read without the check


def test_pooled_summary_lacks_a_site_below_the_minimum_and_says_how_many_pooled() -> None:
    cases = [random_case(10, 60), random_case(11, 45)]
    stats = [EvalStats.from_predictions(y, s, loss_sum=0.1 * len(y)) for y, s in cases]
    pooled = pooled_summary([stats[0], None, stats[1]])
    both = stats[0] + stats[1]
    assert pooled["n_sites"] == 2 and pooled["n_sites_too_few"] == 1 and pooled["n_samples"] == 105
    assert pooled["micro_f1"] == both.summary()["micro_f1"] and pooled["map"] == both.summary()["map"]
    assert pooled["loss"] == pytest.approx(0.1)
    assert pooled_summary([stats[1], None, stats[0]]) == pooled  # independent of the sites' order
    nothing = pooled_summary([None, None])
    assert nothing == {
        "loss": None,
        "micro_f1": None,
        "map": None,
        "map_present": None,
        "n_samples": 0,
        "n_sites": 0,
        "n_sites_too_few": 2,
    }


def test_contribution_summary_shows_the_marker() -> None:
    assert contribution_summary(None) == {TOO_FEW_RECORDS: True}
    summary = contribution_summary(EvalStats.from_predictions(*random_case(6, 30)))
    assert summary[TOO_FEW_RECORDS] is False and summary["n_samples"] == 30


def test_mean_summary_weights_each_site_by_its_test_records() -> None:
    first = {"loss": 1.0, "micro_f1": 0.5, "map": 0.2, "map_present": None, "n_samples": 10}
    second = {"loss": 0.4, "micro_f1": 0.8, "map": 0.5, "map_present": 0.6, "n_samples": 30}
    mean = mean_summary([first, second])
    assert mean["loss"] == pytest.approx(0.55) and mean["micro_f1"] == pytest.approx(0.725)
    assert mean["map"] == pytest.approx(0.425)
    assert mean["map_present"] == pytest.approx(0.6)  # only the site that defines it
    assert mean["n_samples"] == 40 and mean["n_sites"] == 2
