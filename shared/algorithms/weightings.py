"""Aggregation weightings w_k: `samples` (FedAvg), `equal`, and DataTools4Heart's smoothing and uncertainty.

WEIGHTINGS maps the names a study config may use to rules that return unnormalised weights;
`aggregation_weights` normalises them; shared/algorithms/aggregation.py averages with the result. The last
two are papers/003's weight smoothing and uncertainty-aware aggregation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from shared.algorithms.params import NoParams, SmoothedParams, UncertaintyParams
from shared.errors import StudyRuleError

__all__ = [
    "ENTROPY_METRIC",
    "WEIGHTINGS",
    "Weighting",
    "aggregation_weights",
    "smoothed",
    "uncertainty",
    "weighting_report",
]

ENTROPY_METRIC = "entropy"  # the update metric holding H_k (site_agent/algorithms/uncertainty.py)


def smoothed(num_examples: Sequence[int], _metrics: Sequence[Mapping[str, Any]], params: BaseModel) -> list[float]:
    """w_k = alpha/K + (1 - alpha) * n_k/n: alpha 0 is `samples`, alpha 1 is `equal`."""
    assert isinstance(params, SmoothedParams)
    k, n = len(num_examples), math.fsum(num_examples)
    return [params.alpha / k + (1.0 - params.alpha) * n_k / n for n_k in num_examples]


def uncertainty(num_examples: Sequence[int], metrics: Sequence[Mapping[str, Any]], params: BaseModel) -> list[float]:
    """w_k ∝ n_k / (H_k + epsilon), H_k the site's reported MC-dropout entropy (metric `entropy`)."""
    assert isinstance(params, UncertaintyParams)
    weights = []
    for index, (n_k, site_metrics) in enumerate(zip(num_examples, metrics, strict=True)):
        entropy = site_metrics.get(ENTROPY_METRIC)
        if (
            not isinstance(entropy, int | float)
            or isinstance(entropy, bool)
            or not math.isfinite(entropy)
            or entropy < 0
        ):
            raise StudyRuleError(
                f"update {index} reports no usable {ENTROPY_METRIC!r} metric ({entropy!r}); "
                "uncertainty weighting needs H_k >= 0 from every site"
            )
        if entropy + params.epsilon <= 0:
            raise StudyRuleError(f"update {index}: H_k + epsilon is 0; set epsilon > 0")
        weights.append(n_k / (entropy + params.epsilon))
    return weights


@dataclass(frozen=True)
class Weighting:
    """An aggregation weighting: its parameters and the unnormalised weight of every site."""

    params: type[BaseModel]
    # (n_k of every site, metrics every site reported, params) -> one weight >= 0 per site
    weights: Callable[[Sequence[int], Sequence[Mapping[str, Any]], BaseModel], Sequence[float]]
    reads: tuple[str, ...] = ()  # the metrics `weights` reads: all a secure round relays to the other sites


def _by_samples(num_examples: Sequence[int], _metrics: Sequence[Mapping[str, Any]], _p: BaseModel) -> list[float]:
    return [float(n) for n in num_examples]


def _equally(num_examples: Sequence[int], _metrics: Sequence[Mapping[str, Any]], _p: BaseModel) -> list[float]:
    return [1.0] * len(num_examples)


WEIGHTINGS: dict[str, Weighting] = {
    "samples": Weighting(NoParams, _by_samples),  # w_k ∝ n_k (FedAvg)
    "equal": Weighting(NoParams, _equally),  # w_k = 1/K
    "smoothed": Weighting(SmoothedParams, smoothed),  # w_k = alpha/K + (1 - alpha) n_k/n
    "uncertainty": Weighting(UncertaintyParams, uncertainty, (ENTROPY_METRIC,)),  # w_k ∝ n_k / (H_k + epsilon)
}


def aggregation_weights(
    num_examples: Sequence[int],
    name: str = "samples",
    params: Mapping[str, Any] | None = None,
    *,
    metrics: Sequence[Mapping[str, Any]] | None = None,
) -> list[float]:
    """Normalised weights w_k (summing to 1) of the sites whose sample counts are `num_examples`."""
    if not num_examples:
        raise StudyRuleError("no updates to weight")
    if any(n <= 0 for n in num_examples):
        raise StudyRuleError(f"every n_k must be positive, got {list(num_examples)}")
    rule = _weighting(name)
    site_metrics = list(metrics) if metrics is not None else [{} for _ in num_examples]
    if len(site_metrics) != len(num_examples):
        raise StudyRuleError("metrics must have one entry per site")
    raw = [float(w) for w in rule.weights(num_examples, site_metrics, rule.params.model_validate(params or {}))]
    if len(raw) != len(num_examples) or not all(math.isfinite(w) and w >= 0 for w in raw) or sum(raw) <= 0:
        raise StudyRuleError(f"weighting {name!r} gave unusable weights {raw}")
    total = math.fsum(raw)
    return [w / total for w in raw]


def weighting_report(name: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a site's metrics that weighting `name` reads: what a secure round signs and relays to peers."""
    return {key: metrics[key] for key in _weighting(name).reads if key in metrics}


def _weighting(name: str) -> Weighting:
    try:
        return WEIGHTINGS[name]
    except KeyError:
        raise StudyRuleError(f"unknown aggregation weighting {name!r}; choose one of {sorted(WEIGHTINGS)}") from None
