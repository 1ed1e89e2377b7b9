"""The server's update of theta^g: a weighted average, or Scaffold's step with its control variate.

Both are fed stored updates a window at a time (`adding`, as coordinator/storage/stored_updates.py reads
them) or in memory (`add`, as the in-process experiment runner does), so memory stays a few models'
worth whatever the number of sites, and both paths give bit-identical results. A secure round
hands them its unmasked sums instead (`take_sums`): the same server step on those sums. One round's
step is composed in shared/study/server_round.py, for the coordinator and the runner alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from shared.algorithms.aggregation import AlignedPiece, WeightedAverage
from shared.algorithms.exchange import SCAFFOLD_C, SCAFFOLD_DELTA_C
from shared.errors import AggregationError
from shared.tensors.codec import TensorSpec

__all__ = ["ScaffoldAggregator", "ServerAggregator", "next_global"]

TensorDict = dict[str, Tensor]


class ServerAggregator(WeightedAverage):
    """theta^g_t = Σ_k w_k θ_k / Σ_k w_k over the shared tensors (FedAvg and every algorithm but Scaffold).

    `previous` is None here; an aggregator that needs theta^g_{t-1} (and the server state stored
    with it) sets it to an empty average, which the caller fills with that blob (weight 1) before
    any update.
    """

    previous: WeightedAverage | None = None


class ScaffoldAggregator(ServerAggregator):
    """Scaffold's server (Karimireddy et al., 2020, Alg. 1; FedCVD `scaffold.py`).

    x <- x + server_lr * (Σ_k w_k y_k - x) over the shared model tensors (integer buffers take the
    maximum, as in every average), and c <- c + (|S|/N) * mean_k(delta c_k) = c + Σ_k delta c_k / N,
    N the study's enrolled sites. Updates hold `scaffold.delta_c.<param>`; the global blob holds
    `scaffold.c.<param>`.
    """

    def __init__(self, server_lr: float, n_sites: int) -> None:
        super().__init__()
        if n_sites < 1:
            raise AggregationError(f"n_sites must be >= 1, got {n_sites}")
        self.server_lr, self.n_sites = server_lr, n_sites
        self.previous = WeightedAverage()

    def weighs(self, name: str) -> bool:
        """The model's tensors take the updates' weights; the delta c are summed plainly."""
        return not name.startswith(SCAFFOLD_DELTA_C)

    @contextmanager
    def adding(
        self, specs: Mapping[str, TensorSpec], weights: Sequence[float], order: Sequence[str] | None = None
    ) -> Iterator[Callable[[Iterable[AlignedPiece]], None]]:
        """As WeightedAverage.adding, for updates that must hold floating delta c tensors."""
        deltas = [name for name in specs if not self.weighs(name)]
        if not deltas:
            raise AggregationError(f"a Scaffold update must hold {SCAFFOLD_DELTA_C}<param> tensors")
        if not all(specs[name].dtype.is_floating_point for name in deltas):
            raise AggregationError("delta c tensors must be floating point")
        with super().adding(specs, weights, order) as accumulate:
            yield accumulate

    def result(self) -> TensorDict:
        """theta^g_t with the new c; `previous` must hold theta^g_{t-1} and c."""
        if self.previous is None or self.previous.count != 1:
            raise AggregationError("Scaffold's update needs theta^g_{t-1} with c added to `previous` exactly once")
        average, previous = super().result(), self.previous.result()
        out: TensorDict = {}
        for name, mean in average.items():
            if not self.weighs(name):
                continue
            if name not in previous:
                raise AggregationError(f"theta^g_{{t-1}} lacks {name!r}")
            out[name] = torch.lerp(previous[name], mean, self.server_lr) if mean.is_floating_point() else mean
        for delta_name in average.keys() - out.keys():
            total = self._sums[delta_name]  # Σ_k delta c_k, unweighted
            name = SCAFFOLD_C + delta_name.removeprefix(SCAFFOLD_DELTA_C)
            if name not in previous:
                raise AggregationError(f"theta^g_{{t-1}} lacks the server control variate {name!r}")
            c = previous[name]
            out[name] = (c.to(total.dtype) + total / self.n_sites).to(c.dtype)
        return out


def next_global(
    aggregator: ServerAggregator,
    previous: Mapping[str, Tensor],
    updates: Iterable[tuple[Mapping[str, Tensor], float]],
) -> TensorDict:
    """theta^g_t from theta^g_{t-1} (with its server state) and in-memory (tensors, weight) updates."""
    if aggregator.previous is not None:
        aggregator.previous.add(previous, 1.0)
    for tensors, weight in updates:
        aggregator.add(tensors, weight)
    return aggregator.result()
