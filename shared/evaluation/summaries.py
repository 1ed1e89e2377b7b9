"""Per-site and pooled evaluation summaries from what sites report (docs/data-owner/privacy.md).

Each site reports its personalised model as exact scalars (`local_eval`) and the global
evaluation model's counts and histograms on its test split (`eval_stats`), or the marker of too
few records. Per site the coordinator shows the scalars, and for `eval` a summary of the site's
contribution (or the marker); pooled, it sums the contributions (Global metrics, with how many sites
and records they pool) and averages the personalised scalars weighted by test records.

Every summary carries FedCVD's figures (shared/evaluation/metrics.py) and the clinical ones: exact with
bootstrap intervals in a site's own report (shared/evaluation/bootstrap.py), with bounds and intervals
from the counts and histograms otherwise (shared/evaluation/clinical.py, calibration.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.errors import MetricsError
from shared.evaluation.bootstrap import BOOTSTRAPPED, site_clinical
from shared.evaluation.clinical import pooled_clinical
from shared.evaluation.figure_names import CLINICAL_METRICS, SUMMARY_METRICS
from shared.evaluation.metrics import (
    TOO_FEW_RECORDS,
    EvalStats,
    Summary,
    exact_summary,
    json_safe,
    parse_contribution,
)

__all__ = [
    "check_reports",
    "contribution_summary",
    "mean_summary",
    "pooled_summaries",
    "pooled_summary",
    "site_summaries",
    "site_summary",
    "summary_of_total",
]


SUMMARY_REPORT = {*SUMMARY_METRICS, "n_samples"}  # what a site's report holds whatever its number of records


def site_summary(y_true: npt.ArrayLike, y_score: npt.ArrayLike, loss_sum: float, *, seed: int | None) -> Summary:
    """A site's exact report of a model: FedCVD's figures and, given a seed, the clinical ones with their intervals.

    The site passes no seed when its test split is below the study's `privacy.min_records`: then only
    FedCVD's scalars leave, as before.
    """
    truth, scores = np.asarray(y_true), np.asarray(y_score)
    summary = exact_summary(truth, scores, loss_sum)
    return summary if seed is None else {**summary, **site_clinical(truth, scores, seed=seed)}


def _contribution(metrics: Mapping[str, Any], n_classes: int, min_records: int | None) -> tuple[bool, EvalStats | None]:
    """(whether the site reported `eval_stats`, its statistics or None for the too-few-records marker)."""
    raw = metrics.get("eval_stats")
    if raw is None:
        return False, None
    stats = parse_contribution(raw, min_records=min_records)
    if stats is not None and stats.n_classes != n_classes:
        raise MetricsError(f"eval_stats has {stats.n_classes} classes, the study's model has {n_classes}")
    return True, stats


def check_reports(metrics: Mapping[str, Any], n_classes: int, min_records: int) -> None:
    """ValueError when `eval_stats` is malformed, of another model, or of fewer than `min_records` records.

    So are clinical figures in `local_eval` of fewer than `min_records` records (such a site sends FedCVD's
    alone), a macro over more classes than the model has, and an interval whose ends are swapped.
    """
    _contribution(metrics, n_classes, min_records)
    local = metrics.get("local_eval") or {}
    clinical = sorted(key for key, value in local.items() if key not in SUMMARY_REPORT and value is not None)
    if clinical and int(local.get("n_samples", 0)) < min_records:
        raise MetricsError(
            f"local_eval reports {', '.join(clinical)} of {local.get('n_samples')} test records, below the "
            f"study's privacy.min_records {min_records}: such a site reports loss, micro_f1, map and map_present only"
        )
    classes = local.get("auroc_classes")
    if classes is not None and classes > n_classes:
        raise MetricsError(f"local_eval averages {classes} classes; the study's model has {n_classes}")
    if classes == 0 and any(local.get(name) is not None for name in CLINICAL_METRICS if name != "ece"):
        raise MetricsError("local_eval reports macro figures over no class with both positives and negatives")
    for name in BOOTSTRAPPED:
        low, high = local.get(f"{name}_low"), local.get(f"{name}_high")
        if (low is None) != (high is None):
            raise MetricsError(f"local_eval: the interval of {name} has one end only")
        if low is not None and high is not None and low > high:
            raise MetricsError(f"local_eval: the interval of {name} ends below its start ({low} > {high})")


def site_summaries(metrics: Mapping[str, Any], n_classes: int) -> dict[str, Summary | None]:
    """One site's summaries: `eval` (its contribution, or the marker) and `local_eval` (its exact scalars)."""
    reported, stats = _contribution(metrics, n_classes, None)
    local = metrics.get("local_eval")
    return {
        "eval": contribution_summary(stats) if reported else None,
        "local_eval": dict(local) if local is not None else None,
    }


def pooled_summaries(
    reports: Iterable[tuple[int, Mapping[str, Any]]], n_classes: int, *, trained: bool = True
) -> dict[str, float | Summary | None]:
    """Over the sites' (n_k, metrics): n_k-weighted train loss, pooled `eval` and averaged `local_eval`.

    A round in which nothing trained (`trained` False: the final evaluation) has no train loss.
    """
    counts, losses = [], []
    contributions: list[EvalStats | None] = []
    personalised: list[Mapping[str, Any]] = []
    for num_examples, metrics in reports:
        counts.append(num_examples)
        losses.append(float(metrics["loss"]))
        reported, stats = _contribution(metrics, n_classes, None)
        if reported:
            contributions.append(stats)
        if metrics.get("local_eval") is not None:
            personalised.append(metrics["local_eval"])
    examples, loss = sum(counts), None
    if trained and examples:
        # a mean of fractions of each loss (float64) cannot overflow the way the sum of n_k * loss_k can
        loss = math.fsum(n / examples * value for n, value in zip(counts, losses, strict=True))
    return {
        "train_loss": loss if loss is not None and math.isfinite(loss) else None,
        "eval": pooled_summary(contributions) if contributions else None,
        "local_eval": mean_summary(personalised) if personalised else None,
    }


def contribution_summary(stats: EvalStats | None) -> Summary:
    """Counts and histograms summarised (FedCVD's and the clinical figures), or the marker of too few records."""
    if stats is None:
        return {TOO_FEW_RECORDS: True}
    figures = json_safe({**stats.summary(), **pooled_clinical(stats)})
    return {**figures, "n_samples": stats.n_samples, TOO_FEW_RECORDS: False}


def pooled_summary(contributions: Iterable[EvalStats | None]) -> Summary:
    """Summary of the summed statistics (None marks a site with too few records), with how many sites pooled.

    The loss sum is added with `math.fsum`, so the result does not depend on the order of the sites.
    Without any site pooled the metrics are None and `n_samples` 0.
    """
    reported = list(contributions)
    pooled = [stats for stats in reported if stats is not None]
    if not pooled:
        return summary_of_total(None, 0, len(reported))
    total = replace(sum(pooled[1:], pooled[0]), loss_sum=math.fsum(stats.loss_sum for stats in pooled))
    return summary_of_total(total, len(pooled), len(reported) - len(pooled))


def summary_of_total(total: EvalStats | None, n_sites: int, n_sites_too_few: int) -> Summary:
    """Summary of summed statistics (None: no site pooled) of `n_sites` sites, `n_sites_too_few` left out."""
    counts = {"n_sites": n_sites, "n_sites_too_few": n_sites_too_few}
    if total is None:
        return {**dict.fromkeys(SUMMARY_METRICS), "n_samples": 0, **counts}
    return {**contribution_summary(total), **counts}


def mean_summary(summaries: Iterable[Mapping[str, Any]]) -> Summary:
    """The sites' exact summaries averaged, each metric weighted by test records over the sites defining it.

    For personalised models there is no one model to pool; this is their mean performance per record
    (the clinical figures too, without intervals: a mean of sites' intervals is not an interval).
    """
    reported = list(summaries)
    averaged: Summary = {"n_samples": sum(int(s["n_samples"]) for s in reported), "n_sites": len(reported)}
    clinical = [key for key in CLINICAL_METRICS if any(s.get(key) is not None for s in reported)]
    for key in (*SUMMARY_METRICS, *clinical):
        defined = [(int(s["n_samples"]), float(s[key])) for s in reported if s.get(key) is not None]
        weight = sum(n for n, _ in defined)
        averaged[key] = math.fsum(n / weight * value for n, value in defined) if weight else None
    return averaged
