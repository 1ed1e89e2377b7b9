"""The numbers a clinician asks for: AUROC, sensitivity, specificity and balanced accuracy, with their bounds.

Per site they are exact, from the site's own scores (`exact_clinical`). Pooled they come from what sites
already send (shared/evaluation/metrics.py `EvalStats`: per-class score histograms of positives and
negatives, whose bin `N_BINS // 2` starts at score 0.5), so no new per-sample data leaves a site:

- AUROC from the histograms (`binned_auroc`): a pair of a positive and a negative in different bins is
  ordered exactly; a pair inside one bin is not. With t_b positives and f_b negatives in bin b, F_<b
  negatives in the bins below it, P positives and N negatives, the exact AUROC lies in

      [sum_b t_b F_<b, sum_b t_b (F_<b + f_b)] / (P N)

  and the midpoint (a pair inside a bin counted as a tie, 1/2, as scikit-learn counts tied scores) is
  within sum_b t_b f_b / (2 P N) of it. Macro-AUROC is the mean over the classes with both positives and
  negatives, and says how many those are.
- Sensitivity, specificity and balanced accuracy at 0.5 are exact from the counts EvalStats already
  holds (`ClassCounts.of`), per site and pooled alike, each proportion with its 95% Wilson interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.stats import rankdata

from shared.errors import MetricsError
from shared.evaluation.metrics import EvalStats

__all__ = [
    "Z_95",
    "BinnedAuroc",
    "ClassCounts",
    "binned_auroc",
    "exact_auroc",
    "wilson_interval",
]

Z_95 = 1.959963984540054  # the standard normal's 97.5th percentile
Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class BinnedAuroc:
    """Per-class AUROC from score histograms: the midpoint and the most it can be from the exact value."""

    auroc: Floats  # (C,) NaN for a class without positives or without negatives
    bound: Floats  # (C,) |auroc - exact| <= bound; NaN where auroc is

    @property
    def defined(self) -> npt.NDArray[np.bool_]:
        """The classes with both positives and negatives."""
        return ~np.isnan(self.auroc)

    def macro(self) -> tuple[float | None, float | None, int]:
        """(macro-AUROC, its bound, how many classes it averages); None when no class has both kinds."""
        count = int(self.defined.sum())
        if count == 0:
            return None, None, 0
        return float(np.nanmean(self.auroc)), float(np.nanmean(self.bound)), count


def binned_auroc(pos_hist: npt.ArrayLike, neg_hist: npt.ArrayLike) -> BinnedAuroc:
    """Per-class AUROC of (C, bins) histograms of positives and negatives, bins in ascending score order."""
    pos, neg = np.asarray(pos_hist, dtype=np.float64), np.asarray(neg_hist, dtype=np.float64)
    if pos.shape != neg.shape or pos.ndim != 2 or (pos < 0).any() or (neg < 0).any():
        raise MetricsError(f"histograms must be two non-negative (C, bins) arrays, got {pos.shape} and {neg.shape}")
    below = np.cumsum(neg, axis=1) - neg  # F_<b: negatives in the lower bins
    pairs = pos.sum(axis=1) * neg.sum(axis=1)  # P N
    with np.errstate(invalid="ignore", divide="ignore"):
        auroc = np.where(pairs > 0, (pos * (below + neg / 2)).sum(axis=1) / pairs, np.nan)
        bound = np.where(pairs > 0, (pos * neg).sum(axis=1) / (2 * pairs), np.nan)
    return BinnedAuroc(auroc, bound)


def exact_auroc(y_true: npt.ArrayLike, y_score: npt.ArrayLike) -> Floats:
    """Per-class AUROC of (n, C) labels and scores, tied scores counting 1/2 (Mann-Whitney); NaN without both kinds."""
    truth, scores = np.asarray(y_true, dtype=bool), np.asarray(y_score, dtype=np.float64)
    if truth.shape != scores.shape or truth.ndim != 2:
        raise MetricsError(
            f"labels and scores must be two (n, C) arrays of one shape, got {truth.shape}, {scores.shape}"
        )
    out = np.full(truth.shape[1], np.nan)
    for c in range(truth.shape[1]):
        positives = int(truth[:, c].sum())
        negatives = truth.shape[0] - positives
        if positives and negatives:
            ranks: Floats = np.asarray(rankdata(scores[:, c]), dtype=np.float64)  # tied scores share their mean rank
            u = float(ranks[truth[:, c]].sum()) - positives * (positives + 1) / 2
            out[c] = u / (positives * negatives)
    return out


@dataclass(frozen=True)
class ClassCounts:
    """Per-class counts at the 0.5 threshold: the confusion matrix of each class."""

    tp: Ints
    fp: Ints
    fn: Ints
    tn: Ints

    @classmethod
    def of(cls, stats: EvalStats) -> ClassCounts:
        """The counts a site's (or a pool's) EvalStats already hold, with TN = n - TP - FP - FN."""
        tp, fp, fn = (np.asarray(counts, dtype=np.int64) for counts in (stats.tp, stats.fp, stats.fn))
        return cls(tp=tp, fp=fp, fn=fn, tn=stats.n_samples - tp - fp - fn)

    def sensitivity(self) -> Floats:
        """TP / (TP + FN) per class; NaN without positives."""
        return _ratio(self.tp, self.tp + self.fn)

    def specificity(self) -> Floats:
        """TN / (TN + FP) per class; NaN without negatives."""
        return _ratio(self.tn, self.tn + self.fp)

    def balanced_accuracy(self) -> Floats:
        """(sensitivity + specificity) / 2 per class; NaN without both kinds."""
        return (self.sensitivity() + self.specificity()) / 2

    def sensitivity_interval(self) -> tuple[Floats, Floats]:
        """The 95% Wilson interval of each class's sensitivity."""
        return wilson_interval(self.tp, self.tp + self.fn)

    def specificity_interval(self) -> tuple[Floats, Floats]:
        """The 95% Wilson interval of each class's specificity."""
        return wilson_interval(self.tn, self.tn + self.fp)


def wilson_interval(successes: npt.ArrayLike, trials: npt.ArrayLike, z: float = Z_95) -> tuple[Floats, Floats]:
    """The Wilson score interval of successes / trials (elementwise); NaN where there are no trials."""
    k, n = np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
    if (k < 0).any() or (k > n).any():
        raise MetricsError("successes must lie between 0 and the trials")
    z2 = z * z
    with np.errstate(invalid="ignore", divide="ignore"):
        centre = (k + z2 / 2) / (n + z2)
        half = z * np.sqrt(k * (n - k) / n + z2 / 4) / (n + z2)
        low = np.where(n > 0, np.maximum(centre - half, 0.0), np.nan)
        high = np.where(n > 0, np.minimum(centre + half, 1.0), np.nan)
    return low, high


def _ratio(numerator: Ints, denominator: Ints) -> Floats:
    """Numerator / denominator elementwise, NaN where the denominator is 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / np.maximum(denominator, 1), math.nan)
