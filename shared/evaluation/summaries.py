"""Per-site and pooled evaluation summaries from what sites report (docs/data-owner/privacy.md).

Each site reports its personalised model as exact scalars (`local_eval`) and the global
evaluation model's counts and histograms on its test split (`eval_stats`), or the marker of too
few records. Per site the coordinator shows the scalars, and for `eval` a summary of the site's
contribution (or the marker); pooled, it sums the contributions (Global metrics, with how many sites
and records they pool) and averages the personalised scalars weighted by test records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from shared.errors import MetricsError
from shared.evaluation.metrics import (
    EvalStats,
    Summary,
    contribution_summary,
    mean_summary,
    parse_contribution,
    pooled_summary,
)

__all__ = ["check_reports", "pooled_summaries", "site_summaries"]


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
    """ValueError when `eval_stats` is malformed, of another model, or of fewer than `min_records` records."""
    _contribution(metrics, n_classes, min_records)


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
