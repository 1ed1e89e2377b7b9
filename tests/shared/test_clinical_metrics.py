"""Clinical metrics against scikit-learn: exact per site, pooled from histograms within their stated bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.calibration import calibration_curve
from sklearn.metrics import balanced_accuracy_score, recall_score, roc_auc_score

from shared.errors import MetricsError
from shared.evaluation.bootstrap import site_clinical
from shared.evaluation.calibration import binned_calibration, exact_calibration
from shared.evaluation.clinical import Z_95, ClassCounts, binned_auroc, exact_auroc, pooled_clinical, wilson_interval
from shared.evaluation.metrics import EvalStats


def predictions(seed: int, n: int = 400, classes: int = 5, spread: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """Labels with a rare and a missing class, and scores that rank them imperfectly (some ties)."""
    rng = np.random.default_rng(seed)
    truth = rng.random((n, classes)) < np.array([0.4, 0.1, 0.02, 0.5, 0.0])[:classes]
    logits = rng.normal(0, 1, (n, classes)) + spread * (truth - 0.5)
    scores = 1 / (1 + np.exp(-logits))
    scores[: n // 10] = np.round(scores[: n // 10], 2)  # ties, as a calibrated model's rounded outputs give
    return truth, scores.astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
def test_the_exact_auroc_is_scikit_learns(seed: int) -> None:
    truth, scores = predictions(seed)
    ours = exact_auroc(truth, scores)
    for c in range(truth.shape[1]):
        if 0 < truth[:, c].sum() < len(truth):
            assert ours[c] == pytest.approx(roc_auc_score(truth[:, c], scores[:, c]), abs=1e-12)
        else:
            assert np.isnan(ours[c])  # no positives (class 4): undefined, as scikit-learn refuses it


@pytest.mark.parametrize("seed", range(4))
def test_sensitivity_specificity_and_balanced_accuracy_are_scikit_learns(seed: int) -> None:
    truth, scores = predictions(seed)
    counts = ClassCounts.of(EvalStats.from_predictions(truth, scores))
    for c in range(3):  # classes with both kinds
        predicted = scores[:, c] >= 0.5
        assert counts.sensitivity()[c] == pytest.approx(recall_score(truth[:, c], predicted))
        assert counts.specificity()[c] == pytest.approx(recall_score(truth[:, c], predicted, pos_label=0))
        assert counts.balanced_accuracy()[c] == pytest.approx(balanced_accuracy_score(truth[:, c], predicted))
    assert np.isnan(counts.sensitivity()[4]) and not np.isnan(counts.specificity()[4])


@pytest.mark.parametrize("seed", range(4))
def test_the_histograms_sites_send_give_an_auroc_within_its_bound(seed: int) -> None:
    truth, scores = predictions(seed, n=2000)
    stats = EvalStats.from_predictions(truth, scores)
    binned, exact = binned_auroc(stats.pos_hist, stats.neg_hist), exact_auroc(truth, scores)
    defined = ~np.isnan(exact)
    assert np.array_equal(binned.defined, defined)
    assert (np.abs(binned.auroc[defined] - exact[defined]) <= binned.bound[defined] + 1e-12).all()
    assert (binned.bound[defined] < 0.01).all()  # 1,000 logit bins: pairs inside one bin are few
    macro, bound, count = binned.macro()
    assert count == int(defined.sum()) and macro == pytest.approx(np.nanmean(exact), abs=bound + 1e-12)


def test_pooling_sites_histograms_bounds_the_auroc_of_all_their_records() -> None:
    (truth_a, scores_a), (truth_b, scores_b) = predictions(7, n=600), predictions(8, n=900, spread=1.0)
    pooled = EvalStats.from_predictions(truth_a, scores_a) + EvalStats.from_predictions(truth_b, scores_b)
    binned = binned_auroc(pooled.pos_hist, pooled.neg_hist)
    truth, scores = np.vstack([truth_a, truth_b]), np.vstack([scores_a, scores_b])
    exact = exact_auroc(truth, scores)
    defined = ~np.isnan(exact)
    assert (np.abs(binned.auroc[defined] - exact[defined]) <= binned.bound[defined] + 1e-12).all()
    # the pooled counts give the sensitivity and specificity of all the records, as scikit-learn computes them
    counts = ClassCounts.of(pooled)
    for c in range(3):
        predicted = scores[:, c] >= 0.5
        assert counts.sensitivity()[c] == pytest.approx(recall_score(truth[:, c], predicted))
        assert counts.specificity()[c] == pytest.approx(recall_score(truth[:, c], predicted, pos_label=0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12))
def test_the_bound_holds_for_any_order_inside_the_bins(cells: list[tuple[int, int]]) -> None:
    pos, neg = np.array([[p for p, _ in cells]]), np.array([[n for _, n in cells]])
    binned = binned_auroc(pos, neg)
    if pos.sum() == 0 or neg.sum() == 0:
        assert not binned.defined.any() and binned.macro() == (None, None, 0)
        return
    # the two extreme orders inside every bin b: its positives all above its negatives, or all below
    labels = [label for p, n in cells for label in [0] * n + [1] * p]
    above = [score for b, (p, n) in enumerate(cells) for score in [b + 0.25] * n + [b + 0.75] * p]
    below = [score for b, (p, n) in enumerate(cells) for score in [b + 0.75] * n + [b + 0.25] * p]
    best, worst = roc_auc_score(labels, above), roc_auc_score(labels, below)
    for value in (best, worst):
        assert abs(binned.auroc[0] - value) <= binned.bound[0] + 1e-12
    assert best - worst == pytest.approx(2 * binned.bound[0])  # the bound is attained: it cannot be tighter


def test_wilson_intervals_are_the_textbook_values() -> None:
    low, high = wilson_interval(np.array([8, 0, 10]), np.array([10, 10, 10]))
    assert low[0] == pytest.approx(0.4902, abs=1e-4) and high[0] == pytest.approx(0.9433, abs=1e-4)
    assert low[1] == 0.0 and high[1] == pytest.approx(0.2775, abs=1e-4)  # none of 10: not a zero-width interval
    assert high[2] == 1.0 and low[2] == pytest.approx(0.7225, abs=1e-4)
    assert np.isnan(wilson_interval(np.array([0]), np.array([0]))[0]).all()
    with pytest.raises(MetricsError):
        wilson_interval(np.array([3]), np.array([2]))


def test_malformed_histograms_are_refused() -> None:
    with pytest.raises(MetricsError):
        binned_auroc(np.zeros((2, 10)), np.zeros((2, 9)))
    with pytest.raises(MetricsError):
        binned_auroc(-np.ones((1, 4)), np.ones((1, 4)))
    with pytest.raises(MetricsError):
        exact_auroc(np.zeros((3, 2)), np.zeros((3, 3)))


def delong_variance(truth: np.ndarray, scores: np.ndarray) -> float:
    """DeLong, DeLong and Clarke-Pearson (1988) from the structural components, written out (ties count 1/2)."""
    positives, negatives = scores[truth], scores[~truth]
    beats = (positives[:, None] > negatives[None, :]) + 0.5 * (positives[:, None] == negatives[None, :])
    v10, v01 = beats.mean(axis=1), beats.mean(axis=0)
    return float(v10.var(ddof=1) / len(positives) + v01.var(ddof=1) / len(negatives))


def at_bin_centres(seed: int, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Scores on logit-bin centres, so that binning loses nothing: the binned figures must be the exact ones."""
    rng = np.random.default_rng(seed)
    truth = rng.random((n, 3)) < np.array([0.3, 0.05, 0.6])
    bins = np.clip(rng.normal(500, 40, (n, 3)) + 60 * truth, 0, 999).astype(int)
    return truth, (1 / (1 + np.exp(-(-16 + 0.032 * (bins + 0.5))))).astype(np.float64)


@pytest.mark.parametrize("seed", range(3))
def test_the_pooled_auroc_variance_is_delongs_when_binning_loses_nothing(seed: int) -> None:
    truth, scores = at_bin_centres(seed)
    stats = EvalStats.from_predictions(truth, scores)
    binned = binned_auroc(stats.pos_hist, stats.neg_hist)
    for c in range(3):
        assert binned.auroc[c] == pytest.approx(roc_auc_score(truth[:, c], scores[:, c]), abs=1e-12)
        assert binned.variance[c] == pytest.approx(delong_variance(truth[:, c], scores[:, c]), rel=1e-9)
    macro, bound, _ = binned.macro()
    low, high = binned.macro_interval()
    assert macro is not None and bound is not None and low is not None and high is not None
    half = Z_95 * np.sqrt(binned.variance.sum()) / 3 + bound
    assert low == pytest.approx(max(macro - half, 0)) and high == pytest.approx(min(macro + half, 1))


def test_a_single_positive_gets_the_conservative_variance() -> None:
    binned = binned_auroc(np.array([[0, 1, 0]]), np.array([[3, 0, 2]]))
    assert binned.auroc[0] == pytest.approx(0.6) and binned.variance[0] == pytest.approx(0.6 * 0.4 / 1)


@pytest.mark.parametrize("seed", range(3))
def test_macro_sensitivity_specificity_and_balanced_accuracy_are_scikit_learns(seed: int) -> None:
    truth, scores = predictions(seed)
    stats = EvalStats.from_predictions(truth, scores)
    classes = binned_auroc(stats.pos_hist, stats.neg_hist).defined
    figures = pooled_clinical(stats)
    predicted = scores >= 0.5
    kept = np.flatnonzero(classes)
    assert figures["sensitivity"] == pytest.approx(recall_score(truth[:, kept], predicted[:, kept], average="macro"))
    assert figures["specificity"] == pytest.approx(
        np.mean([recall_score(truth[:, c], predicted[:, c], pos_label=0) for c in kept])
    )
    assert figures["balanced_accuracy"] == pytest.approx(
        np.mean([balanced_accuracy_score(truth[:, c], predicted[:, c]) for c in kept])
    )
    assert figures["auroc_classes"] == len(kept) == 4
    for name in ("sensitivity", "specificity", "balanced_accuracy", "macro_auroc"):
        low, value, high = figures[f"{name}_low"], figures[name], figures[f"{name}_high"]
        assert isinstance(low, float) and isinstance(value, float) and isinstance(high, float)
        assert 0 <= low < value < high <= 1


def test_the_exact_calibration_is_scikit_learns_reliability_curve() -> None:
    rng = np.random.default_rng(3)
    scores = rng.choice(np.arange(10) / 10 + 0.05, size=(2000, 4))  # decile centres: no bin edge in doubt
    truth = rng.random((2000, 4)) < scores**1.5  # over-confident
    reliability = exact_calibration(truth, scores)
    observed, predicted = calibration_curve(truth.ravel(), scores.ravel(), n_bins=10)
    assert np.allclose(reliability.observed, observed) and np.allclose(reliability.predicted, predicted)
    counts = np.bincount(np.floor(scores.ravel() * 10).astype(int), minlength=10)
    assert reliability.ece == pytest.approx(float((counts * np.abs(observed - predicted)).sum() / counts.sum()))
    assert reliability.ece_bound == 0 and [row["count"] for row in reliability.rows()] == counts.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_the_pooled_calibration_is_within_its_stated_error_of_the_exact_one(seed: int) -> None:
    (truth_a, scores_a), (truth_b, scores_b) = predictions(seed, n=700), predictions(seed + 10, n=500, spread=4.0)
    pooled = EvalStats.from_predictions(truth_a, scores_a) + EvalStats.from_predictions(truth_b, scores_b)
    binned = binned_calibration(pooled.pos_hist, pooled.neg_hist)
    exact = exact_calibration(np.vstack([truth_a, truth_b]), np.vstack([scores_a, scores_b]))
    assert binned.ece is not None and exact.ece is not None
    assert abs(binned.ece - exact.ece) <= binned.ece_bound + 1e-12 and binned.ece_bound < 0.005
    assert np.array_equal(binned.count, exact.count) and np.allclose(binned.observed, exact.observed, equal_nan=True)
    filled = binned.count > 0
    gap = np.abs(binned.predicted - exact.predicted)[filled]
    assert (gap <= binned.predicted_error[filled] + 1e-12).all()


def test_the_site_bootstrap_is_reproducible_and_brackets_its_figures() -> None:
    truth, scores = predictions(5, n=500)
    figures = site_clinical(truth, scores, seed=11, resamples=100)
    assert figures == site_clinical(truth, scores, seed=11, resamples=100)  # the round's seed: a rerun agrees
    assert figures != site_clinical(truth, scores, seed=12, resamples=100)
    assert figures["macro_auroc"] == pytest.approx(np.nanmean(exact_auroc(truth, scores)))
    assert all(isinstance(value, float | int) for value in figures.values())  # only scalars: ends, never draws
    for name in ("macro_auroc", "balanced_accuracy", "sensitivity", "specificity", "ece"):
        low, value, high = figures[f"{name}_low"], figures[name], figures[f"{name}_high"]
        assert isinstance(low, float) and isinstance(value, float) and isinstance(high, float)
        assert low <= value <= high and high - low < 0.2
    smaller = site_clinical(truth[:100], scores[:100], seed=11, resamples=100)
    width = {k: figures[f"{k}_high"] - figures[f"{k}_low"] for k in ("macro_auroc", "sensitivity")}  # type: ignore[operator]
    assert all(smaller[f"{k}_high"] - smaller[f"{k}_low"] > w for k, w in width.items())  # type: ignore[operator]


def test_the_bootstrap_interval_covers_the_auroc_at_its_level() -> None:
    """Over repeated test sets drawn from one model, the interval holds the true macro-AUROC about 95% of the time."""
    covered, trials = 0, 60
    for trial in range(trials):
        truth, scores = predictions(100 + trial, n=200, classes=2)
        figures = site_clinical(truth, scores, seed=trial, resamples=200)
        # the population AUROC of a unit-variance logit shifted by 2: Phi(2 / sqrt 2)
        covered += figures["macro_auroc_low"] <= 0.9213503964748575 <= figures["macro_auroc_high"]  # type: ignore[operator]
    assert covered >= 0.85 * trials


def test_a_perfectly_calibrated_site_reports_an_ece_of_zero_not_none() -> None:
    truth = np.tile(np.array([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=bool), (10, 1))
    figures = site_clinical(truth, truth.astype(np.float64), seed=0, resamples=20)
    assert figures["ece"] == 0.0 and figures["ece_low"] == 0.0 and figures["ece_high"] == 0.0
    assert figures["macro_auroc"] == 1.0
