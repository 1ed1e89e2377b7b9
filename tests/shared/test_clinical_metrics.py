"""Clinical metrics against scikit-learn: exact per site, pooled from histograms within their stated bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import balanced_accuracy_score, recall_score, roc_auc_score

from shared.errors import MetricsError
from shared.evaluation.clinical import ClassCounts, binned_auroc, exact_auroc, wilson_interval
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
