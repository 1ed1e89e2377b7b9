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
  negatives, and says how many those are. Its 95% interval is DeLong's over the binned placements (a
  positive in bin b beats (F_<b + f_b / 2) / N of the negatives, a negative in bin b is beaten by
  (T_>b + t_b / 2) / P of the positives), widened on each side by the binning bound.
- Sensitivity, specificity and balanced accuracy at 0.5 are exact from the counts EvalStats already
  holds (`ClassCounts.of`), per site and pooled alike, each proportion with its 95% Wilson interval.

Macro figures average the classes with both positives and negatives. Their intervals combine the
classes' standard errors as if the classes were independent (sqrt(sum se_c^2) / C); the classes share
records, so this is an approximation, stated wherever the interval is shown. Per site, the site's
bootstrap (shared/evaluation/bootstrap.py) needs no such assumption.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.errors import MetricsError
from shared.evaluation.calibration import binned_calibration
from shared.evaluation.metrics import EvalStats

__all__ = [
    "Z_95",
    "BinnedAuroc",
    "ClassCounts",
    "binned_auroc",
    "exact_auroc",
    "macro_standard_error",
    "pooled_clinical",
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
    variance: Floats  # (C,) DeLong's variance over the binned placements (A (1 - A) / min(P, N) if one of a kind)

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

    def macro_interval(self, z: float = Z_95) -> tuple[float | None, float | None]:
        """The macro-AUROC's interval: DeLong's (classes as independent) widened by the binning bound."""
        macro, bound, count = self.macro()
        if macro is None or bound is None:
            return None, None
        half = z * macro_standard_error(np.sqrt(self.variance[self.defined])) + bound
        return max(macro - half, 0.0), min(macro + half, 1.0)


def binned_auroc(pos_hist: npt.ArrayLike, neg_hist: npt.ArrayLike) -> BinnedAuroc:
    """Per-class AUROC of (C, bins) histograms of positives and negatives, bins in ascending score order."""
    pos, neg = np.asarray(pos_hist, dtype=np.float64), np.asarray(neg_hist, dtype=np.float64)
    if pos.shape != neg.shape or pos.ndim != 2 or (pos < 0).any() or (neg < 0).any():
        raise MetricsError(f"histograms must be two non-negative (C, bins) arrays, got {pos.shape} and {neg.shape}")
    below = np.cumsum(neg, axis=1) - neg  # F_<b: negatives in the lower bins
    positives, negatives = pos.sum(axis=1, keepdims=True), neg.sum(axis=1, keepdims=True)
    above = positives - np.cumsum(pos, axis=1)  # T_>b: positives in the higher bins
    pairs = (positives * negatives)[:, 0]  # P N
    with np.errstate(invalid="ignore", divide="ignore"):
        auroc = np.where(pairs > 0, (pos * (below + neg / 2)).sum(axis=1) / pairs, np.nan)
        bound = np.where(pairs > 0, (pos * neg).sum(axis=1) / (2 * pairs), np.nan)
        beats = (below + neg / 2) / negatives  # each positive's placement among the negatives
        beaten = (above + pos / 2) / positives  # each negative's placement among the positives
        spread = auroc[:, None]
        s10 = (pos * (beats - spread) ** 2).sum(axis=1) / (positives[:, 0] - 1)
        s01 = (neg * (beaten - spread) ** 2).sum(axis=1) / (negatives[:, 0] - 1)
        delong = s10 / positives[:, 0] + s01 / negatives[:, 0]
        # with a single positive or negative DeLong's is undefined: the bound A (1 - A) / min(P, N) holds for any
        conservative = auroc * (1 - auroc) / np.minimum(positives, negatives)[:, 0]
        variance = np.where((positives[:, 0] > 1) & (negatives[:, 0] > 1), delong, conservative)
    return BinnedAuroc(auroc, bound, variance)


def exact_auroc(y_true: npt.ArrayLike, y_score: npt.ArrayLike) -> Floats:
    """Per-class AUROC of (n, C) labels and scores, tied scores counting 1/2 (Mann-Whitney); NaN without both kinds."""
    truth, scores = np.asarray(y_true, dtype=bool), np.asarray(y_score, dtype=np.float64)
    if truth.shape != scores.shape or truth.ndim != 2:
        raise MetricsError(
            f"labels and scores must be two (n, C) arrays of one shape, got {truth.shape}, {scores.shape}"
        )
    from scipy.stats import rankdata  # here, not at the top: scipy.stats costs every process ~1 s of CPU to import

    out = np.full(truth.shape[1], np.nan)
    ranks: Floats = np.asarray(rankdata(scores, axis=0), dtype=np.float64)  # tied scores share their mean rank
    for c in range(truth.shape[1]):
        positives = int(truth[:, c].sum())
        negatives = truth.shape[0] - positives
        if positives and negatives:
            u = float(ranks[truth[:, c], c].sum()) - positives * (positives + 1) / 2
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

    def macro(self, classes: npt.NDArray[np.bool_], z: float = Z_95) -> dict[str, float | None]:
        """Macro sensitivity, specificity and balanced accuracy over `classes`, each with its 95% interval.

        Each class's standard error is read off its Wilson interval ((high - low) / 2z); a balanced
        accuracy's is half the root of its two; the macro's combines them as `macro_standard_error`.
        """
        if not classes.any():
            return {
                f"{name}{end}": None
                for name in ("sensitivity", "specificity", "balanced_accuracy")
                for end in ("", "_low", "_high")
            }
        errors = {}
        out: dict[str, float | None] = {}
        for name, values, (low, high) in (
            ("sensitivity", self.sensitivity(), self.sensitivity_interval()),
            ("specificity", self.specificity(), self.specificity_interval()),
        ):
            errors[name] = (high - low)[classes] / (2 * z)
            out |= _centred(name, float(values[classes].mean()), macro_standard_error(errors[name]), z)
        balanced = float(self.balanced_accuracy()[classes].mean())
        per_class = np.sqrt(errors["sensitivity"] ** 2 + errors["specificity"] ** 2) / 2
        return out | _centred("balanced_accuracy", balanced, macro_standard_error(per_class), z)


def macro_standard_error(per_class: npt.ArrayLike) -> float:
    """The standard error of a mean over classes from theirs, the classes taken as independent."""
    errors = np.asarray(per_class, dtype=np.float64)
    return float(np.sqrt((errors**2).sum()) / errors.size)


def _centred(name: str, value: float, error: float, z: float) -> dict[str, float | None]:
    """`name`, `name_low`, `name_high`: value +- z error, inside [0, 1]."""
    return {name: value, f"{name}_low": max(value - z * error, 0.0), f"{name}_high": min(value + z * error, 1.0)}


def pooled_clinical(stats: EvalStats) -> dict[str, float | int | None]:
    """The clinical figures of (pooled) EvalStats: AUROC with bound and DeLong interval, counts' Wilson, ECE.

    Macro figures average the classes with both positives and negatives (`auroc_classes` of them).
    """
    auroc = binned_auroc(stats.pos_hist, stats.neg_hist)
    macro, bound, count = auroc.macro()
    low, high = auroc.macro_interval()
    calibration = binned_calibration(stats.pos_hist, stats.neg_hist)
    return {
        "macro_auroc": macro,
        "macro_auroc_bound": bound,
        "macro_auroc_low": low,
        "macro_auroc_high": high,
        "auroc_classes": count,
        **ClassCounts.of(stats).macro(auroc.defined),
        "ece": calibration.ece,
        "ece_bound": calibration.ece_bound,
    }


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
