"""Central DP for a buffered study's release: each clipped change against its own base, summed on the grid, noised.

    theta^g_{v+1} = theta^g_v + eta 2^-f (Σ_k trunc(s(τ_k) c_k) + N_Z(0, sigma^2)) / n,

over the n updates of the buffer (M, or fewer at its deadline): c_k = rint((θ_k - theta^g_{b_k}) 2^f) is
update k's change read back on the grid against the version b_k it trained from (each site clipped it
to the norm bound Delta there: an update beyond it fails the release), s(τ_k) <= 1 its staleness
weight, applied on the grid and truncated toward zero so that no coordinate grows and the scaled
change stays within Delta. The divisor is the count n, not the staleness weights' sum: the noise's
scale on theta^g is fixed by the terms. Each release is one Gaussian mechanism of sensitivity Delta per
site, which takes part in it at most once and may take part in every release: the terms' rounds count
releases, and epsilon is accounted per release as for a synchronous study whose every site takes
part in every round (shared/study/accounting.py). Integer tensors are the updates' maximum, as in
every average.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from shared.algorithms.aggregation import WeightedAverage
from shared.errors import AggregationError
from shared.study.dp import GRID_BITS, CentralNoiseAverage
from shared.terms import DifferentialPrivacy

__all__ = ["BufferedCentralNoise"]


class BufferedCentralNoise(CentralNoiseAverage):
    """A buffered release under central DP: fed theta^g_v (`previous`), each base version (`version`), the updates."""

    release = "the buffer"

    def __init__(
        self,
        dp: DifferentialPrivacy,
        server_lr: float,
        bases: Sequence[int],
        factors: Sequence[float],
        fraction_bits: int = GRID_BITS,
    ) -> None:
        super().__init__(dp, fraction_bits)
        if len(bases) != len(factors) or any(not 0 < f <= 1 for f in factors):
            raise AggregationError("give each update its base version and a staleness weight in (0, 1]")
        self.server_lr, self.bases, self.factors = server_lr, list(bases), list(factors)
        self._versions: dict[Hashable, WeightedAverage] = {base: WeightedAverage() for base in sorted(set(bases))}

    def version(self, base: int) -> WeightedAverage:
        """Where theta^g of version `base` is added, once with weight 1."""
        if base not in self._versions:
            raise AggregationError(f"no update of the buffer trained from version {base}")
        return self._versions[base]

    def _base_sources(self) -> dict[Hashable, WeightedAverage]:
        """Every version an update of the buffer trained from, each added once."""
        if self.previous is None or self.previous.count != 1:
            raise AggregationError("a buffered release needs theta^g_v added to `previous` once, before any update")
        for base, average in self._versions.items():
            if average.count != 1:
                raise AggregationError(f"theta^g of version {base} must be added to `version({base})` once")
        return dict(self._versions)

    def _base_key(self, index: int) -> Hashable:
        """b_k of update k."""
        if index >= len(self.bases):
            raise AggregationError(f"update {index + 1} added for the {len(self.bases)} bases given")
        return self.bases[index]

    def _scaled(self, index: int, codes: Tensor) -> Tensor:
        """s(τ_k) c_k truncated toward zero: no coordinate grows, the norm stays within Delta."""
        return (codes.double() * self.factors[index]).trunc().to(torch.int64)

    def _moved_from(self, released: Mapping[str, Tensor], noised: Mapping[str, np.ndarray]) -> dict[str, Tensor]:
        """theta^g_v + eta (the noised sum) 2^-f / n."""
        if self.count != len(self.bases):
            raise AggregationError(f"{self.count} updates were added for the {len(self.bases)} bases given")
        assert self.previous is not None
        previous, out = self.previous.result(), dict(released)
        for name, steps in noised.items():
            change = torch.from_numpy(steps.astype(np.float64)) * 2.0**-self.fraction_bits / self.count
            moved = previous[name].double().reshape(-1) + self.server_lr * change
            out[name] = moved.reshape(previous[name].shape).to(previous[name].dtype)
        return out
