"""Server-side aggregation math: normalised site weights, and a weighted average fed one update at a time.

Pure functions over name-keyed tensors: the coordinator feeds it stored uploads, the in-process
experiment runner feeds it in-memory states. Memory is one model's worth whatever the number of
sites, because each update is added in place and may be dropped before the next one is read.

Rule for non-floating tensors (BatchNorm's `num_batches_tracked`, any bool or integer buffer):
the result is the element-wise maximum over the updates. A count of steps has no meaningful
weighted mean; the maximum is exact, monotone across rounds, and what the longest-trained site saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel
from torch import Tensor

from shared.algorithms.params import NoParams, SmoothedParams, UncertaintyParams
from shared.algorithms.weightings import smoothed, uncertainty
from shared.partition import TensorSpec
from shared.tensors import schema_of

__all__ = ["WEIGHTINGS", "WeightedAverage", "Weighting", "aggregation_weights", "weighted_average"]

TensorDict = dict[str, Tensor]


@dataclass(frozen=True)
class Weighting:
    """An aggregation weighting: its parameters and the unnormalised weight of every site."""

    params: type[BaseModel]
    # (n_k of every site, metrics every site reported, params) -> one weight >= 0 per site
    weights: Callable[[Sequence[int], Sequence[Mapping[str, Any]], BaseModel], Sequence[float]]


def _by_samples(num_examples: Sequence[int], _metrics: Sequence[Mapping[str, Any]], _p: BaseModel) -> list[float]:
    return [float(n) for n in num_examples]


def _equally(num_examples: Sequence[int], _metrics: Sequence[Mapping[str, Any]], _p: BaseModel) -> list[float]:
    return [1.0] * len(num_examples)


WEIGHTINGS: dict[str, Weighting] = {
    "samples": Weighting(NoParams, _by_samples),  # w_k ∝ n_k (FedAvg)
    "equal": Weighting(NoParams, _equally),  # w_k = 1/K
    "smoothed": Weighting(SmoothedParams, smoothed),  # w_k = alpha/K + (1 - alpha) n_k/n
    "uncertainty": Weighting(UncertaintyParams, uncertainty),  # w_k ∝ n_k / (H_k + epsilon)
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
        raise ValueError("no updates to weight")
    if any(n <= 0 for n in num_examples):
        raise ValueError(f"every n_k must be positive, got {list(num_examples)}")
    try:
        rule = WEIGHTINGS[name]
    except KeyError:
        raise ValueError(f"unknown aggregation weighting {name!r}; choose one of {sorted(WEIGHTINGS)}") from None
    site_metrics = list(metrics) if metrics is not None else [{} for _ in num_examples]
    if len(site_metrics) != len(num_examples):
        raise ValueError("metrics must have one entry per site")
    raw = [float(w) for w in rule.weights(num_examples, site_metrics, rule.params.model_validate(params or {}))]
    if len(raw) != len(num_examples) or not all(math.isfinite(w) and w >= 0 for w in raw) or sum(raw) <= 0:
        raise ValueError(f"weighting {name!r} gave unusable weights {raw}")
    total = math.fsum(raw)
    return [w / total for w in raw]


class WeightedAverage:
    """Σ_k w_k θ_k / Σ_k w_k over name-keyed tensors, accumulated one update at a time.

    Floating tensors accumulate in place (`acc.add_(t, alpha=w)`) in float32, or float64 for
    float64 inputs, and come back in their own dtype. Other tensors take the element-wise maximum
    (see the module docstring). The updates may be read-only views of stored bytes: they are only read.
    """

    def __init__(self) -> None:
        self._sums: TensorDict = {}
        self._flat: TensorDict = {}  # each sum viewed as 1-D, where pieces land
        self._dtypes: dict[str, torch.dtype] = {}
        self._total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Add one update with weight `weight` (>= 0); every update must have the same names and shapes."""
        pieces = ((name, 0, tensor.reshape(-1)) for name, tensor in tensors.items())
        self.add_pieces(schema_of(tensors), pieces, weight)

    def add_pieces(
        self, specs: Mapping[str, TensorSpec], pieces: Iterable[tuple[str, int, Tensor]], weight: float
    ) -> None:
        """Add one update that arrives as flat pieces `(name, first element, 1-D values)`.

        `specs` names the update's tensors; the pieces must cover each of them exactly once (as
        shared.tensors.tensor_pieces yields them), so a stored update is added while it is read and
        is never whole in memory. An error midway leaves this average unusable.
        """
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        first = self.count == 0
        if first:
            self._allocate(specs)
        else:
            self._check(specs)
        for name, start, values in pieces:
            total = self._flat[name][start : start + values.numel()]
            if first and total.is_floating_point():
                torch.mul(values, weight, out=total)
            elif first:
                total.copy_(values)
            elif total.is_floating_point():
                total.add_(values, alpha=weight)
            else:
                torch.maximum(total, values, out=total)
        self._total_weight += weight
        self.count += 1

    def _allocate(self, specs: Mapping[str, TensorSpec]) -> None:
        self._sums, self._flat, self._dtypes = {}, {}, {}
        for name, spec in specs.items():
            self._dtypes[name] = spec.dtype
            dtype = _accumulator_dtype(spec.dtype) if spec.dtype.is_floating_point else spec.dtype
            self._sums[name] = torch.empty(spec.shape, dtype=dtype)
            self._flat[name] = self._sums[name].view(-1)

    def _check(self, specs: Mapping[str, TensorSpec]) -> None:
        if specs.keys() != self._sums.keys():
            missing, extra = self._sums.keys() - specs.keys(), specs.keys() - self._sums.keys()
            raise ValueError(f"update names differ from the first update's: missing {missing}, extra {extra}")
        for name, spec in specs.items():
            total = self._sums[name]
            if spec.shape != tuple(total.shape) or spec.dtype != self._dtypes[name]:
                raise ValueError(
                    f"tensor {name!r} is {spec.dtype}{list(spec.shape)}, expected "
                    f"{self._dtypes[name]}{list(total.shape)}"
                )

    def result(self) -> TensorDict:
        """The average so far, each tensor in its input dtype."""
        if self.count == 0:
            raise ValueError("no update was added")
        if self._total_weight <= 0:
            raise ValueError("the weights of the added updates sum to zero")
        out: TensorDict = {}
        for name, total in self._sums.items():
            if total.is_floating_point():
                out[name] = (total / self._total_weight).to(self._dtypes[name])
            else:
                out[name] = total.clone()
        return out


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def weighted_average(updates: Iterable[tuple[Mapping[str, Tensor], float]]) -> TensorDict:
    """Weighted average of (tensors, weight) pairs, consuming the iterable one update at a time."""
    average = WeightedAverage()
    for tensors, weight in updates:
        average.add(tensors, weight)
    return average.result()
