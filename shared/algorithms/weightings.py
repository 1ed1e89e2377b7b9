"""DataTools4Heart's aggregation weightings (papers/003): weight smoothing and uncertainty awareness.

Registered in shared/aggregation.py WEIGHTINGS next to `samples` and `equal`; each returns
unnormalised weights that `aggregation_weights` normalises.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from shared.algorithms.params import SmoothedParams, UncertaintyParams

__all__ = ["ENTROPY_METRIC", "smoothed", "uncertainty"]

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
        usable = isinstance(entropy, int | float) and not isinstance(entropy, bool) and math.isfinite(entropy)
        if not usable or entropy < 0:
            raise ValueError(
                f"update {index} reports no usable {ENTROPY_METRIC!r} metric ({entropy!r}); "
                "uncertainty weighting needs H_k >= 0 from every site"
            )
        if entropy + params.epsilon <= 0:
            raise ValueError(f"update {index}: H_k + epsilon is 0; set epsilon > 0")
        weights.append(n_k / (entropy + params.epsilon))
    return weights
