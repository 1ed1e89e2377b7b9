"""A site's clinical figures, exact from its own scores, with 95% bootstrap intervals of which only the ends leave.

The site resamples its test records with replacement `RESAMPLES` times (a generator seeded by the
round's seed, so a rerun reports the same interval), recomputes each figure on every resample and
reports the 2.5th and 97.5th percentiles (`<name>_low`, `<name>_high`): the percentile bootstrap
(Efron and Tibshirani 1993, ch. 13). Resampling records keeps the classes' dependence, so the macro
intervals need no assumption of independent classes. A resample without any class of both kinds has
no macro figure and is left out of that figure's percentiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.evaluation.calibration import calibration_in_bins, reliability_bins
from shared.evaluation.clinical import ClassCounts, exact_auroc
from shared.evaluation.metrics import THRESHOLD, f1_from_counts, mean_average_precision

__all__ = ["BOOTSTRAPPED", "RESAMPLES", "site_clinical"]

RESAMPLES = 200
BOOTSTRAPPED = (  # the figures a site reports with their interval ends
    "micro_f1",
    "map",
    "macro_auroc",
    "balanced_accuracy",
    "sensitivity",
    "specificity",
    "ece",
)


@dataclass(frozen=True)
class _Records:
    """A site's test records with what every resample reads of them computed once."""

    truth: npt.NDArray[np.bool_]  # (n, C)
    scores: npt.NDArray[np.float64]
    predicted: npt.NDArray[np.bool_]  # score >= 0.5
    bins: npt.NDArray[np.int64]  # reliability bin of each score

    def __getitem__(self, rows: npt.NDArray[np.int64]) -> _Records:
        return _Records(self.truth[rows], self.scores[rows], self.predicted[rows], self.bins[rows])


def _figures(records: _Records) -> dict[str, float]:
    """The figures of one set of records; NaN where undefined (no class with both kinds)."""
    truth, predicted = records.truth, records.predicted
    auroc = exact_auroc(truth, records.scores)
    classes = ~np.isnan(auroc)
    tp, fp, fn = ((a & b).sum(axis=0) for a, b in ((predicted, truth), (predicted, ~truth), (~predicted, truth)))
    counts = ClassCounts(tp, fp, fn, len(truth) - tp - fp - fn)
    figures = {
        "micro_f1": f1_from_counts(int(tp.sum()), int(fp.sum()), int(fn.sum())),
        "map": mean_average_precision(truth, records.scores)[0],
        "auroc_classes": float(classes.sum()),
        "ece": _or_nan(calibration_in_bins(records.bins, truth, records.scores).ece),
    }
    if not classes.any():
        return figures | dict.fromkeys(("macro_auroc", "balanced_accuracy", "sensitivity", "specificity"), np.nan)
    return figures | {
        "macro_auroc": float(auroc[classes].mean()),
        "balanced_accuracy": float(counts.balanced_accuracy()[classes].mean()),
        "sensitivity": float(counts.sensitivity()[classes].mean()),
        "specificity": float(counts.specificity()[classes].mean()),
    }


def site_clinical(
    y_true: npt.ArrayLike, y_score: npt.ArrayLike, *, seed: int, resamples: int = RESAMPLES
) -> dict[str, float | int | None]:
    """Macro-AUROC, balanced accuracy, sensitivity, specificity and ECE, and the bootstrap interval of each.

    The intervals of micro-F1 and mAP come too (`micro_f1_low`, ...). None where undefined.
    """
    truth, scores = np.asarray(y_true, dtype=bool), np.asarray(y_score, dtype=np.float64)
    records = _Records(truth, scores, scores >= THRESHOLD, reliability_bins(scores))
    point = _figures(records)
    rng = np.random.default_rng(seed)
    rows = [_figures(records[i]) for i in _resampled(rng, len(truth), resamples)]
    draws = np.array([[row[name] for name in BOOTSTRAPPED] for row in rows])
    out: dict[str, float | int | None] = {"auroc_classes": int(point["auroc_classes"])}
    for column, name in enumerate(BOOTSTRAPPED):
        values = draws[:, column][~np.isnan(draws[:, column])]
        defined = not np.isnan(point[name])
        if name not in ("micro_f1", "map"):
            out[name] = float(point[name]) if defined else None
        ends = [float(end) for end in np.percentile(values, [2.5, 97.5])] if defined and values.size else [None, None]
        out[f"{name}_low"], out[f"{name}_high"] = ends
    return out


def _or_nan(value: float | None) -> float:
    """NaN for an undefined figure (a perfect 0.0 stays 0.0)."""
    return float("nan") if value is None else value


def _resampled(rng: np.random.Generator, n: int, resamples: int) -> list[npt.NDArray[np.int64]]:
    """`resamples` draws of n record indices with replacement."""
    return [rng.integers(0, n, n) for _ in range(resamples)]
