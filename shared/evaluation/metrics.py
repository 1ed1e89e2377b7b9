"""FedCVD's evaluation metrics (micro-F1 at 0.5, per-class AP, mAP) and what a site reports of them.

Exact metrics follow scikit-learn as FedCVD calls it: `f1_score(average="micro", zero_division=0)` on
`score >= 0.5`, and `average_precision_score(average=None)` with a class that has no positives
scoring 0 (scikit-learn >= 1.4); mAP averages all classes, and `map_present` only those with positives.

What leaves a site (docs/data-owner/privacy.md): no per-sample prediction, ever.

- Per-site metrics are scalars the site computes exactly from its own scores (`exact_summary`):
  loss, micro-F1, mAP, mAP over present classes and the number of test records.
- Pooled ("global") metrics come from an `EvalStats` per site (TP/FP/FN per class and per-class score
  histograms of its positives and negatives), summed across sites (`pooled_summary`). A site sends
  them only of at least the study's `privacy.min_records` test records; below that it sends the
  marker `{"too_few_records": true}` (`site_contribution`) and the pool lacks its records.

Micro-F1 from the counts is exact. AP from the histograms assumes the positives and negatives
inside one bin interleave evenly; its error is bounded below.

Bins and the AP error bound
---------------------------
There are `N_BINS` = 1000 bins, uniform in logit(score) over [-16, 16] (scores are probabilities in
[0, 1]; the end bins also take everything beyond, and float32 probabilities saturate near logit 16.6).
Logit spacing keeps resolution where a trained model's scores pile up, next to 0 and 1. Bin
`N_BINS // 2` starts exactly at score 0.5, so the histograms also determine TP/FP/FN.

The AP of a bin's positives depends only on how they interleave with the bin's negatives. For a
bin b with t_b positives and f_b negatives, T positives and N samples in the bins above it, and P
positives in all, the j-th positive of the bin sees a precision between (T + j) / (N + f_b + j) (all
of the bin's negatives ranked first) and (T + t_b) / (N + t_b) (all of its positives first and tied).
Summed over the positives this gives `EvalStats.ap_bounds()`, a per-class interval that always holds
the exact AP of the underlying scores, ties or not:

    low  = 1/P * sum_b sum_{j=1..t_b} (T + j) / (N + f_b + j)
    high = 1/P * sum_b t_b * (T + t_b) / (N + t_b)

The histogram AP (`EvalStats.average_precision`, even interleaving: (T + j) / (N + j * (1 + f_b /
(t_b + 1)))) lies inside the interval, so |AP_hist - AP_exact| <= high - low for every class, and
the pooled mAP's error is at most the mean of those widths. The bound is computed from the same
statistics; it shrinks as fewer bins mix positives with negatives. On 2,000-20,000 samples with
scores spread over a few logit units the estimate is within about 1e-3 of scikit-learn and the
interval below 0.01 wide; near-constant scores (an untrained model) put everything in a few bins
and widen it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import MetricsError

__all__ = [
    "LOGIT_RANGE",
    "N_BINS",
    "THRESHOLD",
    "TOO_FEW_RECORDS",
    "EvalStats",
    "Summary",
    "average_precision",
    "exact_summary",
    "f1_from_counts",
    "json_safe",
    "mean_average_precision",
    "micro_f1",
    "parse_contribution",
    "score_bins",
    "site_contribution",
]

N_BINS = 1000  # histogram bins for pooled AP, uniform in logit over [-LOGIT_RANGE, LOGIT_RANGE]
LOGIT_RANGE = 16.0
THRESHOLD = 0.5  # FedCVD's decision threshold on sigmoid probabilities
_HALF = N_BINS // 2  # first bin at or above THRESHOLD
TOO_FEW_RECORDS = "too_few_records"  # the whole report of a site whose test split is below the minimum

Summary = dict[str, float | int | bool | None]  # JSON-safe: NaN (undefined) is None


def _check_pair(y_true: np.ndarray, y_score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate (N, C) labels in {0, 1} and probabilities in [0, 1]; return (bool labels, float64 scores)."""
    truth = np.asarray(y_true)
    score = np.asarray(y_score, dtype=np.float64)
    if truth.ndim != 2 or score.shape != truth.shape:
        raise MetricsError(f"y_true and y_score must both be (N, C) arrays, got {truth.shape} and {score.shape}")
    if not np.isin(truth, (0, 1)).all():
        raise MetricsError("y_true must contain only 0 and 1")
    if not np.isfinite(score).all() or score.min(initial=0.0) < 0.0 or score.max(initial=0.0) > 1.0:
        raise MetricsError("y_score must be finite probabilities in [0, 1] (apply the sigmoid to logits first)")
    return truth.astype(bool), score


def f1_from_counts(tp: int, fp: int, fn: int) -> float:
    """F1 of summed counts: 2 TP / (2 TP + FP + FN), 0 when there is nothing to count (zero_division=0)."""
    denominator = 2 * tp + fp + fn
    return 2.0 * tp / denominator if denominator else 0.0  # zero_division=0


def _map_pair(ap: np.ndarray, present: np.ndarray) -> tuple[float, float]:
    """(mean over all classes, mean over classes with positives; NaN when there are none)."""
    return float(ap.mean()), float(ap[present].mean()) if present.any() else float("nan")


def micro_f1(y_true: np.ndarray, y_score: np.ndarray, threshold: float = THRESHOLD) -> float:
    """Micro-averaged F1 of `y_score >= threshold` over all samples and classes (0 when undefined)."""
    truth, score = _check_pair(y_true, y_score)
    predicted = score >= threshold
    return f1_from_counts(
        int((predicted & truth).sum()), int((predicted & ~truth).sum()), int((~predicted & truth).sum())
    )


def average_precision(y_true: np.ndarray, y_score: np.ndarray) -> np.ndarray:
    """Per-class AP as scikit-learn computes it (tied scores share one threshold); no positives -> 0.0."""
    truth, score = _check_pair(y_true, y_score)
    n = truth.shape[0]
    if n == 0:
        return np.zeros(truth.shape[1])
    order = np.argsort(-score, axis=0, kind="stable")
    sorted_truth = np.take_along_axis(truth, order, axis=0)
    sorted_score = np.take_along_axis(score, order, axis=0)
    tps = np.cumsum(sorted_truth, axis=0)
    # Precision is evaluated at the last sample of each run of tied scores.
    rank = np.arange(n)[:, None]
    is_last = np.ones_like(truth)
    is_last[:-1] = sorted_score[:-1] != sorted_score[1:]
    last_of_run = np.minimum.accumulate(np.where(is_last, rank, n)[::-1], axis=0)[::-1]
    precision_at_run = np.take_along_axis(tps, last_of_run, axis=0) / (last_of_run + 1)
    positives = tps[-1]
    summed = (precision_at_run * sorted_truth).sum(axis=0)
    ap: np.ndarray = np.divide(summed, positives, out=np.zeros(truth.shape[1]), where=positives > 0)
    return ap


def mean_average_precision(y_true: np.ndarray, y_score: np.ndarray) -> tuple[float, float]:
    """(mAP over all classes with absent classes scoring 0 as in FedCVD, mAP over present classes only)."""
    ap = average_precision(y_true, y_score)
    return _map_pair(ap, np.asarray(y_true).sum(axis=0) > 0)


def score_bins(y_score: np.ndarray) -> np.ndarray:
    """Histogram bin of each probability (same shape, int64); bins at or above N_BINS // 2 hold scores >= 0.5."""
    score = np.asarray(y_score, dtype=np.float64)
    with np.errstate(divide="ignore"):
        logit = np.log(score) - np.log1p(-score)
    bins = np.floor((logit + LOGIT_RANGE) * (N_BINS / (2 * LOGIT_RANGE)))
    bins = np.clip(np.nan_to_num(bins, nan=0.0, posinf=N_BINS - 1, neginf=0.0), 0, N_BINS - 1).astype(np.int64)
    # Rounding must never move a score across the decision threshold.
    above = score >= THRESHOLD
    clamped: np.ndarray = np.where(above, np.maximum(bins, _HALF), np.minimum(bins, _HALF - 1))
    return clamped


def _histograms(truth: np.ndarray, bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n_classes = truth.shape[1]
    flat = (bins + np.arange(n_classes) * N_BINS).ravel()
    size = n_classes * N_BINS
    pos = np.bincount(flat[truth.ravel()], minlength=size).reshape(n_classes, N_BINS)
    neg = np.bincount(flat[~truth.ravel()], minlength=size).reshape(n_classes, N_BINS)
    return pos.astype(np.int64), neg.astype(np.int64)


def _holds_bool(values: list[Any]) -> bool:
    """JSON true/false would pass as 1/0 inside an integer array; refuse them."""
    return any(_holds_bool(v) if isinstance(v, list) else isinstance(v, bool) for v in values)


def _int_array(data: dict[str, Any], key: str, shape: tuple[int, ...]) -> np.ndarray:
    if key not in data:
        raise MetricsError(f"EvalStats: missing field {key!r}")
    value = data[key]
    if not isinstance(value, list):
        raise MetricsError(f"EvalStats: {key} must be a list of integers")
    try:
        array = np.array(value)
    except (ValueError, OverflowError):
        raise MetricsError(f"EvalStats: {key} is not a rectangular list of integers") from None
    if (array.size and array.dtype.kind not in "iu") or _holds_bool(value):
        raise MetricsError(f"EvalStats: {key} must hold integers only, got {array.dtype}")
    if array.shape != shape:
        raise MetricsError(f"EvalStats: {key} must have shape {shape}, got {array.shape}")
    if (array < 0).any():
        raise MetricsError(f"EvalStats: {key} must be non-negative")
    return array.astype(np.int64)


def _precision_sum(t: np.ndarray, above: np.ndarray, offset: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """sum_{j=1..t} (above + j) / (offset + alpha * j), elementwise, in closed form via the digamma function."""
    from scipy.special import digamma  # here: scipy.special costs every process ~0.3 s of CPU to import

    start = offset / alpha
    total: np.ndarray = t / alpha + (alpha * above - offset) / alpha**2 * (
        digamma(start + t + 1.0) - digamma(start + 1.0)
    )
    return total


@dataclass
class EvalStats:
    """Per-site sufficient statistics; the only evaluation data that ever leaves a site.

    Pooling sites is summing: `sum(stats_list, EvalStats.empty())`.
    """

    n_samples: int
    loss_sum: float  # sum of per-sample mean BCE, so pooled loss = loss_sum / n_samples
    tp: np.ndarray  # (C,) int64 at THRESHOLD
    fp: np.ndarray
    fn: np.ndarray
    pos_hist: np.ndarray  # (C, N_BINS) int64 score histograms of positives / negatives per class
    neg_hist: np.ndarray

    @classmethod
    def from_predictions(cls, y_true: np.ndarray, y_score: np.ndarray, loss_sum: float = 0.0) -> EvalStats:
        """Statistics of (N, C) labels and probabilities; `loss_sum` is the caller's summed per-sample loss."""
        truth, score = _check_pair(y_true, y_score)
        pos_hist, neg_hist = _histograms(truth, score_bins(score))
        predicted = score >= THRESHOLD
        return cls(
            n_samples=truth.shape[0],
            loss_sum=float(loss_sum),
            tp=(predicted & truth).sum(axis=0).astype(np.int64),
            fp=(predicted & ~truth).sum(axis=0).astype(np.int64),
            fn=(~predicted & truth).sum(axis=0).astype(np.int64),
            pos_hist=pos_hist,
            neg_hist=neg_hist,
        )

    @classmethod
    def empty(cls, n_classes: int = 20) -> EvalStats:
        """Statistics of no samples: the identity of `+`."""
        zeros = np.zeros(n_classes, dtype=np.int64)
        hist = np.zeros((n_classes, N_BINS), dtype=np.int64)
        return cls(0, 0.0, zeros, zeros.copy(), zeros.copy(), hist, hist.copy())

    @property
    def n_classes(self) -> int:
        """Number of classes C."""
        return len(self.tp)

    @property
    def positives(self) -> np.ndarray:
        """(C,) number of positive samples per class."""
        counts: np.ndarray = self.pos_hist.sum(axis=1)
        return counts

    def __add__(self, other: EvalStats) -> EvalStats:
        if not isinstance(other, EvalStats):
            return NotImplemented
        if other.n_classes != self.n_classes:
            raise MetricsError(f"cannot pool EvalStats of {self.n_classes} and {other.n_classes} classes")
        return EvalStats(
            self.n_samples + other.n_samples,
            self.loss_sum + other.loss_sum,
            self.tp + other.tp,
            self.fp + other.fp,
            self.fn + other.fn,
            self.pos_hist + other.pos_hist,
            self.neg_hist + other.neg_hist,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: counts and histograms as lists of ints, nothing per sample."""
        return {
            "n_bins": N_BINS,
            "n_samples": int(self.n_samples),
            "loss_sum": float(self.loss_sum),
            "tp": self.tp.tolist(),
            "fp": self.fp.tolist(),
            "fn": self.fn.tolist(),
            "pos_hist": self.pos_hist.tolist(),
            "neg_hist": self.neg_hist.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalStats:
        """Parse `to_dict` output, refusing wrong types, shapes, negative or inconsistent counts."""
        if not isinstance(data, dict):
            raise MetricsError("EvalStats: expected a JSON object")
        if data.get("n_bins") != N_BINS:
            raise MetricsError(f"EvalStats: n_bins must be {N_BINS}, got {data.get('n_bins')!r}")
        n_samples = data.get("n_samples")
        if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 0:
            raise MetricsError(f"EvalStats: n_samples must be a non-negative integer, got {n_samples!r}")
        loss_sum = data.get("loss_sum")
        if not isinstance(loss_sum, int | float) or isinstance(loss_sum, bool) or not 0 <= loss_sum < float("inf"):
            raise MetricsError(f"EvalStats: loss_sum must be a finite non-negative number, got {loss_sum!r}")
        tp_raw = data.get("tp")
        n_classes = len(tp_raw) if isinstance(tp_raw, list) else -1
        if n_classes < 1:
            raise MetricsError("EvalStats: tp must be a non-empty list of integers")
        tp, fp, fn = (_int_array(data, key, (n_classes,)) for key in ("tp", "fp", "fn"))
        pos_hist, neg_hist = (_int_array(data, key, (n_classes, N_BINS)) for key in ("pos_hist", "neg_hist"))
        stats = cls(n_samples, float(loss_sum), tp, fp, fn, pos_hist, neg_hist)
        stats._check_consistent()
        return stats

    def _check_consistent(self) -> None:
        if (self.pos_hist.sum(axis=1) + self.neg_hist.sum(axis=1) != self.n_samples).any():
            raise MetricsError("EvalStats: every class's histograms must count exactly n_samples scores")
        above = np.s_[:, _HALF:]
        below = np.s_[:, :_HALF]
        if (
            (self.tp != self.pos_hist[above].sum(axis=1)).any()
            or (self.fp != self.neg_hist[above].sum(axis=1)).any()
            or (self.fn != self.pos_hist[below].sum(axis=1)).any()
        ):
            raise MetricsError("EvalStats: tp/fp/fn disagree with the score histograms at threshold 0.5")

    def _ranked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per bin from the top score down: positives t, negatives f, positives T and samples N above."""
        t = self.pos_hist[:, ::-1].astype(np.float64)
        f = self.neg_hist[:, ::-1].astype(np.float64)
        t_above = np.cumsum(t, axis=1) - t
        n_above = np.cumsum(t + f, axis=1) - t - f
        return t, f, t_above, n_above

    def average_precision(self) -> np.ndarray:
        """Per-class AP from the histograms (even interleaving within a bin), 0.0 for a class without positives."""
        t, f, t_above, n_above = self._ranked()
        return self._per_positive(_precision_sum(t, t_above, n_above, 1.0 + f / (t + 1.0)))

    def ap_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) per class: the exact AP of the underlying scores lies in [low, high] (module docstring)."""
        t, f, t_above, n_above = self._ranked()
        low = _precision_sum(t, t_above, n_above + f, np.ones_like(t))
        denominator = n_above + t
        high = np.divide(t * (t_above + t), denominator, out=np.zeros_like(t), where=denominator > 0)
        return self._per_positive(low), self._per_positive(high)

    def _per_positive(self, per_bin: np.ndarray) -> np.ndarray:
        positives = self.positives
        per_positive: np.ndarray = np.divide(
            per_bin.sum(axis=1), positives, out=np.zeros(self.n_classes), where=positives > 0
        )
        return per_positive

    def summary(self) -> dict[str, float]:
        """loss, micro_f1 (exact), map and map_present (from the histograms), n_samples; NaN where undefined."""
        map_all, map_present = _map_pair(self.average_precision(), self.positives > 0)
        return {
            "loss": self.loss_sum / self.n_samples if self.n_samples else float("nan"),
            "micro_f1": f1_from_counts(int(self.tp.sum()), int(self.fp.sum()), int(self.fn.sum())),
            "map": map_all,
            "map_present": map_present,
            "n_samples": float(self.n_samples),
        }


def json_safe(values: Mapping[str, float | int | None]) -> Summary:
    """NaN (undefined, e.g. mAP over present classes when none is present) becomes None."""
    return {key: None if isinstance(v, float) and not math.isfinite(v) else v for key, v in values.items()}


def exact_summary(y_true: np.ndarray, y_score: np.ndarray, loss_sum: float) -> Summary:
    """A site's scalar report of one model on its test split, exact from its scores: loss, micro-F1, mAPs, n."""
    truth, score = _check_pair(y_true, y_score)
    n_samples = truth.shape[0]
    if n_samples == 0:
        raise MetricsError("a summary needs at least one record")
    present = truth.any(axis=0)
    assert isinstance(present, np.ndarray)  # truth is (N, C): one flag per class, never a scalar
    map_all, map_present = _map_pair(average_precision(truth, score), present)
    values = {"loss": float(loss_sum) / n_samples, "micro_f1": micro_f1(truth, score), "map": map_all}
    return json_safe({**values, "map_present": map_present, "n_samples": n_samples})


def site_contribution(y_true: np.ndarray, y_score: np.ndarray, loss_sum: float, *, min_records: int) -> dict[str, Any]:
    """What a site adds to the pooled statistics: `EvalStats.to_dict()`, or the too-few-records marker alone."""
    if len(y_true) < min_records:
        return {TOO_FEW_RECORDS: True}
    return EvalStats.from_predictions(y_true, y_score, loss_sum=loss_sum).to_dict()


def parse_contribution(data: Any, *, min_records: int | None = None) -> EvalStats | None:
    """A site's pooled contribution (None for the marker); ValueError when malformed or of too few records."""
    if isinstance(data, dict) and TOO_FEW_RECORDS in data:
        if data.get(TOO_FEW_RECORDS) is not True or len(data) != 1:
            raise MetricsError(
                f'the marker of too few records is {{"{TOO_FEW_RECORDS}": true}} and carries nothing else'
            )
        return None
    stats = EvalStats.from_dict(data)
    if min_records is not None and stats.n_samples < min_records:
        raise MetricsError(
            f"counts and histograms of {stats.n_samples} test records, below the study's privacy.min_records "
            f'{min_records}: such a site reports {{"{TOO_FEW_RECORDS}": true}} instead'
        )
    return stats
