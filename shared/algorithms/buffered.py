"""FedBuff's server step (Nguyen et al., 2022): a release from a buffer of updates, each against its own base.

    theta^g_{v+1} = theta^g_v + eta * Σ_k u_k (θ_k - theta^g_{b_k}),    u_k = w_k s(τ_k)

over the M updates of a buffer: w_k is update k's weight as the study's weighting gives it within the
buffer (Σ_k w_k = 1), b_k the version it trained from, τ_k = v - b_k the versions it lags behind, s
the staleness weighting and eta the server's learning rate. The u_k are not renormalised: a stale
update moves theta^g less, as in FedBuff. With every base theta^g_v, eta = 1 and fresh updates the
release is the plain weighted average, FedAvg's step. Integer tensors (BatchNorm's counters) take the
maximum over the updates, as in every average.

The updates are fed as to any average (`add`, `adding`: whole, in pieces, or stored windows), each
with its u_k; `bases` takes each distinct base version once, with U_b = Σ_{k: b_k = b} u_k
(`base_weights`), and `previous` theta^g_v with weight 1. Since Σ_k u_k θ_k - Σ_b U_b theta^g_b =
Σ_k u_k (θ_k - theta^g_{b_k}), memory stays a few models' worth whatever the buffer's size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import get_args

from torch import Tensor

from shared.algorithms.aggregation import WeightedAverage
from shared.algorithms.server import ServerAggregator, TensorDict
from shared.errors import AggregationError
from shared.terms import Staleness

__all__ = [
    "STALENESS_RULES",
    "BufferedAggregator",
    "base_weights",
    "buffer_weights",
    "buffered_release",
    "staleness_factor",
]

STALENESS_RULES: tuple[str, ...] = get_args(Staleness)


def staleness_factor(rule: Staleness, staleness: int) -> float:
    """s(τ): 1/sqrt(1 + τ) ("inverse_sqrt", FedBuff's), 1/(1 + τ) ("inverse") or 1 ("constant")."""
    if staleness < 0:
        raise AggregationError(f"an update cannot lag behind by {staleness} versions")
    if rule == "inverse_sqrt":
        return 1.0 / math.sqrt(1 + staleness)
    if rule == "inverse":
        return 1.0 / (1 + staleness)
    if rule == "constant":
        return 1.0
    raise AggregationError(f"unknown staleness weighting {rule!r}; choose one of {list(STALENESS_RULES)}")


def buffer_weights(weights: Sequence[float], staleness: Sequence[int], rule: Staleness) -> list[float]:
    """u_k = w_k s(τ_k) of each update of a buffer, in its order."""
    if len(weights) != len(staleness):
        raise AggregationError(f"{len(weights)} weights for {len(staleness)} updates")
    return [weight * staleness_factor(rule, lag) for weight, lag in zip(weights, staleness, strict=True)]


def base_weights(bases: Sequence[int], weights: Sequence[float]) -> dict[int, float]:
    """U_b = Σ_{k: b_k = b} u_k of each base version, by version, summed in the updates' order."""
    if len(bases) != len(weights):
        raise AggregationError(f"{len(bases)} bases for {len(weights)} updates")
    totals: dict[int, float] = {}
    for base, weight in zip(bases, weights, strict=True):
        totals[base] = totals.get(base, 0.0) + weight
    return dict(sorted(totals.items()))


class BufferedAggregator(ServerAggregator):
    """theta^g_{v+1} from a buffer: the updates (weights u_k), their bases (`bases`), theta^g_v (`previous`)."""

    def __init__(self, server_lr: float) -> None:
        super().__init__()
        if not math.isfinite(server_lr) or server_lr <= 0:
            raise AggregationError(f"the server learning rate must be > 0, got {server_lr}")
        self.server_lr = server_lr
        self.previous = WeightedAverage()
        self.bases = WeightedAverage()

    def result(self) -> TensorDict:
        """theta^g_v + eta * Σ_k u_k (θ_k - theta^g_{b_k}) on floating tensors, in float64, then their dtype."""
        if self.previous is None or self.previous.count != 1:
            raise AggregationError("a buffered release needs theta^g_v added to `previous` exactly once")
        total = self.total_weight
        if self.bases.count == 0 or not math.isclose(self.bases.total_weight, total, rel_tol=1e-9, abs_tol=1e-12):
            raise AggregationError(
                f"the bases' weights sum to {self.bases.total_weight}, the updates' to {total}: give each base "
                "version once with the summed weights of the updates that trained from it"
            )
        updates, bases, previous = super().result(), self.bases.result(), self.previous.result()
        out: TensorDict = {}
        for name, mean in updates.items():
            if name not in previous or name not in bases:
                raise AggregationError(f"theta^g_v or a base version lacks {name!r}")
            if not mean.is_floating_point():
                out[name] = mean
                continue
            change = (mean.double() - bases[name].double()) * total  # Σ_k u_k (θ_k - theta^g_{b_k})
            out[name] = (previous[name].double() + self.server_lr * change).to(previous[name].dtype)
        return out


def buffered_release(
    aggregator: BufferedAggregator,
    current: Mapping[str, Tensor],
    versions: Mapping[int, Mapping[str, Tensor]],
    updates: Sequence[tuple[Mapping[str, Tensor], float, int]],
) -> TensorDict:
    """theta^g_{v+1} from theta^g_v, in-memory updates (tensors, u_k, base version) and the versions they left from."""
    if aggregator.previous is None:
        raise AggregationError("a buffered release needs theta^g_v")
    aggregator.previous.add(current, 1.0)
    totals = base_weights([base for _, _, base in updates], [weight for _, weight, _ in updates])
    missing = sorted(set(totals) - set(versions))
    if missing:
        raise AggregationError(f"updates trained from versions {missing}, which are not given")
    for base, weight in totals.items():
        aggregator.bases.add(versions[base], weight)
    for tensors, weight, _ in updates:
        aggregator.add(tensors, weight)
    return aggregator.result()
