"""Calibration: the expected calibration error and a reliability diagram, exact per site and pooled from histograms.

A multi-label model gives one probability per (record, class); calibration is read over all of them
together. The reliability diagram has ten bins, each made of whole logit bins of the histograms sites
send (shared/evaluation/metrics.py: 1,000 bins uniform in logit over [-16, 16]): logit bin b belongs to
reliability bin floor(10 * sigmoid(centre_b)). A site with the scores puts each score in the same bin
(`score_bins`), so the per-site and pooled diagrams share their bins. For each bin m the diagram shows
its count n_m, the observed fraction of positives o_m (exact from the counts) and the mean predicted
probability e_m; then

    ECE = sum_m n_m / n * |o_m - e_m|        (n: all probabilities, records x classes)

Pooled, e_m is not known exactly: a logit bin's scores lie between the probabilities of its two edges,
so the estimate (each score at its logit bin's probability midpoint) is within the count-weighted
half-width of those intervals, `predicted_error` m; the ECE is within
sum_b n_b * half_width_b / n (`ece_bound`) of the exact ECE of the pooled scores. A logit bin spans
0.032 logit units, so half a bin is at most 0.004 in probability (at 0.5) and far less near 0 and 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

from shared.errors import MetricsError
from shared.evaluation.metrics import LOGIT_RANGE, N_BINS, score_bins

__all__ = [
    "RELIABILITY_BINS",
    "Reliability",
    "binned_calibration",
    "calibration_in_bins",
    "exact_calibration",
    "reliability_bins",
]

RELIABILITY_BINS = 10
Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Reliability:
    """A reliability diagram, bin by bin, and the expected calibration error with the most it can be off."""

    count: npt.NDArray[np.int64]  # (RELIABILITY_BINS,) probabilities in the bin
    observed: Floats  # fraction of them that are positives; NaN for an empty bin
    predicted: Floats  # their mean predicted probability; NaN for an empty bin
    predicted_error: Floats  # |predicted - exact mean| <= this (0 when computed from the scores)
    ece: float | None  # None without any probability
    ece_bound: float

    def rows(self) -> list[dict[str, float | int | None]]:
        """The diagram as JSON-safe rows: bin edges, count, observed, predicted and its error."""
        edges = np.linspace(0.0, 1.0, RELIABILITY_BINS + 1)
        return [
            {
                "low": float(edges[m]),
                "high": float(edges[m + 1]),
                "count": int(self.count[m]),
                "observed": None if np.isnan(self.observed[m]) else float(self.observed[m]),
                "predicted": None if np.isnan(self.predicted[m]) else float(self.predicted[m]),
                "predicted_error": float(self.predicted_error[m]),
            }
            for m in range(RELIABILITY_BINS)
        ]


@cache
def _logit_bins() -> tuple[npt.NDArray[np.int64], Floats, Floats]:
    """Per logit bin: its reliability bin, the midpoint and the half-width of its probability interval."""
    from scipy.special import expit  # here: scipy.special costs every process ~0.3 s of CPU to import

    width = 2 * LOGIT_RANGE / N_BINS
    edges = -LOGIT_RANGE + width * np.arange(N_BINS + 1)
    low, high = expit(edges[:-1]), expit(edges[1:])
    low[0], high[-1] = 0.0, 1.0  # the end bins also take every score beyond the range
    reliability = np.minimum(np.floor(RELIABILITY_BINS * expit(edges[:-1] + width / 2)), RELIABILITY_BINS - 1)
    return reliability.astype(np.int64), (low + high) / 2, (high - low) / 2


def _diagram(count: Floats, positives: Floats, predicted_sum: Floats, error_sum: Floats) -> Reliability:
    """A diagram from per-reliability-bin totals: counts, positives, summed predictions and summed errors."""
    total = count.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        observed, predicted = positives / count, predicted_sum / count
        error = np.where(count > 0, error_sum / np.maximum(count, 1), 0.0)
    gaps = np.where(count > 0, count * np.abs(np.nan_to_num(observed) - np.nan_to_num(predicted)), 0.0)
    ece = float(gaps.sum() / total) if total else None
    return Reliability(
        count.astype(np.int64), observed, predicted, error, ece, float(error_sum.sum() / total) if total else 0.0
    )


def binned_calibration(pos_hist: npt.ArrayLike, neg_hist: npt.ArrayLike) -> Reliability:
    """The diagram and ECE of (C, N_BINS) histograms of positives and negatives, with their stated error."""
    pos, neg = np.asarray(pos_hist, dtype=np.float64), np.asarray(neg_hist, dtype=np.float64)
    if pos.shape != neg.shape or pos.ndim != 2 or pos.shape[1] != N_BINS:
        raise MetricsError(f"histograms must be two (C, {N_BINS}) arrays, got {pos.shape} and {neg.shape}")
    reliability, midpoint, half_width = _logit_bins()
    per_bin, positives = (pos + neg).sum(axis=0), pos.sum(axis=0)
    count, positive, predicted, error = (
        _by_reliability(reliability, values)
        for values in (per_bin, positives, per_bin * midpoint, per_bin * half_width)
    )
    return _diagram(count, positive, predicted, error)


def exact_calibration(y_true: npt.ArrayLike, y_score: npt.ArrayLike) -> Reliability:
    """The diagram and ECE of (n, C) labels and probabilities, in the bins the histograms use."""
    truth, scores = np.asarray(y_true, dtype=bool), np.asarray(y_score, dtype=np.float64)
    if truth.shape != scores.shape:
        raise MetricsError(f"labels and scores must have one shape, got {truth.shape} and {scores.shape}")
    return calibration_in_bins(reliability_bins(scores), truth, scores)


def reliability_bins(y_score: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The reliability bin of each probability (same shape): that of its histogram bin."""
    bins: npt.NDArray[np.int64] = _logit_bins()[0][score_bins(np.asarray(y_score, dtype=np.float64))]
    return bins


def calibration_in_bins(bins: npt.ArrayLike, truth: npt.ArrayLike, scores: npt.ArrayLike) -> Reliability:
    """The diagram and ECE of labels and probabilities whose reliability bins (`reliability_bins`) are known."""
    reliability = np.ravel(bins)
    count, positives, predicted = (
        _by_reliability(reliability, values) for values in (np.ones(reliability.size), truth, scores)
    )
    return _diagram(count, positives, predicted, np.zeros(RELIABILITY_BINS))


def _by_reliability(reliability: npt.NDArray[np.int64], values: npt.ArrayLike) -> Floats:
    """`values` (one per logit bin, or one per score) summed over each reliability bin."""
    weights = np.ravel(np.asarray(values, dtype=np.float64))
    return np.bincount(reliability, weights=weights, minlength=RELIABILITY_BINS).astype(np.float64)
