"""Per-site and pooled evaluation summaries from the EvalStats sites report (DESIGN §6)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from shared.metrics import EvalStats

__all__ = ["STATS_KEYS", "parse_stats", "pooled_summaries", "site_summaries"]

# summary name -> the metrics key whose EvalStats it summarises
STATS_KEYS = {
    "eval": "eval_stats",  # the global evaluation model (theta^g with phi_0) on the site's test split
    "local_eval": "local_eval_stats",  # the site's personalised model on its test split
}

Summary = dict[str, float | None]


def parse_stats(metrics: Mapping[str, Any], n_classes: int) -> dict[str, EvalStats]:
    """The EvalStats a site reported, by summary name; ValueError when one is malformed or of another model."""
    parsed: dict[str, EvalStats] = {}
    for name, key in STATS_KEYS.items():
        raw = metrics.get(key)
        if raw is None:
            continue
        stats = EvalStats.from_dict(raw)
        if stats.n_classes != n_classes:
            raise ValueError(f"{key} has {stats.n_classes} classes, the study's model has {n_classes}")
        parsed[name] = stats
    return parsed


def _summary(stats: EvalStats) -> Summary:
    return {key: (value if math.isfinite(value) else None) for key, value in stats.summary().items()}


def site_summaries(stats: Mapping[str, EvalStats]) -> dict[str, Summary | None]:
    """One site's summaries by name (None where it reported no statistics); JSON-safe (NaN -> None)."""
    return {name: _summary(stats[name]) if name in stats else None for name in STATS_KEYS}


def pooled_summaries(
    reports: Iterable[tuple[int, Mapping[str, Any]]], n_classes: int, *, trained: bool = True
) -> dict[str, float | Summary | None]:
    """Over the sites' (n_k, metrics): n_k-weighted train loss and the summaries of the summed EvalStats.

    A round in which nothing trained (`trained` False: the final evaluation) has no train loss.
    """
    totals: dict[str, EvalStats] = {}
    counts, losses = [], []
    for num_examples, metrics in reports:
        counts.append(num_examples)
        losses.append(float(metrics["loss"]))
        for name, stats in parse_stats(metrics, n_classes).items():
            totals[name] = totals[name] + stats if name in totals else stats
    examples, loss = sum(counts), None
    if trained and examples:
        # a mean of fractions of each loss (float64) cannot overflow the way the sum of n_k * loss_k can
        loss = math.fsum(n / examples * value for n, value in zip(counts, losses, strict=True))
    return {"train_loss": loss if loss is not None and math.isfinite(loss) else None, **site_summaries(totals)}
