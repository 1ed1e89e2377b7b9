"""Per-site head splits (issue #19): which heads a site shares, its masked upload, and their per-head average.

A study may give each site its own H_g:H_l (`model.site_heads`). Its model then holds both
branches at full width (shared/model/network.py `full_width_heads`), so every site uploads the same schema:
head slot h of a block is global at site k when h < H_g,k (the first H_g,k heads), local otherwise.

- Usage: u_{k,b,h} in [0, 1] is how much site k uses head h of block b's global branch: 1 for its
  global heads, 0 for the heads it keeps local (`site_usage`, derived by the coordinator from the
  study config, never read from an upload). Learned heads (shared/algorithms/learned_heads.py) hand
  `HeadSplitAverage` their uploaded usage values (1 - g_{k,h}) instead: it takes any values in [0, 1].
- Upload: the global branch's W_in / W_out slices of the heads a site keeps local are zero
  (`zero_unused_heads`); the coordinator refuses an upload where they are not (`unused_heads_leaked`).
- Aggregation (`HeadSplitAverage`): each head's slices of W_in (weight and bias rows) and W_out
  (weight columns) of the global branch are averaged over the sites that hold it, site k weighted
  w_k * u_{k,b,h} and renormalised per head; W_out's bias (not per head) over the sites that use
  any global head of that block, weighted w_k; every other tensor over every site, weighted w_k,
  as the plain average does. A head (or a bias) that no participating site uses keeps its value of
  theta^g_{t-1}, which the caller adds to `previous`.
- Secure aggregation: the site multiplies each per-head element by its slot's w_k * u_{k,b,h}
  (`slot_factors`, `element_factors`) and sums those factors too (HEAD_WEIGHTS) under the masks;
  `HeadSplitAverage.take_sums` divides each head by its summed weight.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from shared.algorithms.aggregation import AlignedPiece, SumsView, WeightedAverage
from shared.algorithms.server import ServerAggregator
from shared.errors import AggregationError, ModelConfigError
from shared.model.network import ModelConfig
from shared.tensors.codec import TensorSpec

__all__ = [
    "HEAD_TENSOR",
    "HEAD_WEIGHTS",
    "SECURE_MIN_SLOT_WEIGHT",
    "HeadSplitAverage",
    "element_factors",
    "element_slots",
    "per_head_names",
    "site_usage",
    "slot_factors",
    "unused_heads_leaked",
    "zero_unused_heads",
]

TensorDict = dict[str, Tensor]

# blocks.<b>.<branch>_branch.<in_proj|out_proj>.<weight|bias>: the tensors laid out per head
HEAD_WEIGHTS = "heads.slot_weights"  # a secure round's per-head weights w_k * u_{k,b,h}, summed under the masks
# Under secure aggregation a head whose summed weight is at most this keeps theta^g_{t-1}: the fixed-point
# error of a head's mean grows as 1 / its weight sum (K * 2^-(f+1) / W per coordinate, K * 2^-17 at f = 24).
SECURE_MIN_SLOT_WEIGHT = 2.0**-8
HEAD_TENSOR = re.compile(r"^blocks\.(\d+)\.(global|local)_branch\.(in_proj|out_proj)\.(weight|bias)$")


def site_usage(config: ModelConfig) -> Tensor:
    """u_{b,h} of a site of `config`'s split: 1 for its global heads 0..H_g-1, 0 for the rest; (blocks, H)."""
    usage = torch.zeros(config.n_blocks, config.n_heads, dtype=torch.float64)
    usage[:, : config.n_global_heads] = 1.0
    return usage


def element_slots(name: str, config: ModelConfig, start: int, count: int) -> Tensor:
    """The head (0..H-1, or H for W_out's bias: "any head") of elements start..start+count-1 of flat `name`."""
    match = HEAD_TENSOR.match(name)
    if match is None:
        raise ModelConfigError(f"{name!r} is not laid out per head")
    H, E, D = config.n_heads, config.head_dim, config.d_model
    index = torch.arange(start, start + count)
    projection, part = match.group(3), match.group(4)
    if (projection, part) == ("out_proj", "bias"):
        return torch.full((count,), H, dtype=torch.long)
    if (projection, part) == ("in_proj", "weight"):  # (3*H*E, D): row = q/k/v part, head, then E
        return (index // D) % (H * E) // E
    return index % (H * E) // E  # in_proj.bias (3*H*E,) and out_proj.weight (D, H*E) columns


def _head_names(names: Iterable[str], branch: str = "global") -> dict[str, int]:
    """Name -> block of each projection of `branch` ("global" or "local") among `names`."""
    found = {}
    for name in names:
        match = HEAD_TENSOR.match(name)
        if match is not None and match.group(2) == branch:
            found[name] = int(match.group(1))
    return found


def per_head_names(names: Iterable[str]) -> frozenset[str]:
    """The global-branch per-head tensors among `names`: a secure round weighs them per element (`element_factors`)."""
    return frozenset(_head_names(names))


def _unused_mask(name: str, config: ModelConfig, usage: Tensor, block: int, shape: tuple[int, ...]) -> Tensor:
    """True where an element of the global-branch tensor `name` belongs to a head the site does not use."""
    numel = 1
    for size in shape:
        numel *= size
    weights = torch.cat([usage[block], usage[block].amax().reshape(1)])  # slot H: W_out's bias, used with any head
    return (weights[element_slots(name, config, 0, numel)] == 0).view(shape)


def zero_unused_heads(tensors: Mapping[str, Tensor], config: ModelConfig) -> TensorDict:
    """`tensors` with the global branch's slices of the heads this site keeps local set to zero (its upload)."""
    usage = site_usage(config)
    out = dict(tensors)
    for name, block in _head_names(tensors).items():
        mask = _unused_mask(name, config, usage, block, tuple(tensors[name].shape))
        out[name] = tensors[name].masked_fill(mask, 0)
    return out


def unused_heads_leaked(tensors: Mapping[str, Tensor], config: ModelConfig) -> list[str]:
    """Names of the global-branch tensors of an upload whose slices of the site's local heads are not all zero."""
    usage = site_usage(config)
    leaked = []
    for name, block in _head_names(tensors).items():
        mask = _unused_mask(name, config, usage, block, tuple(tensors[name].shape))
        if bool(tensors[name][mask].ne(0).any()):
            leaked.append(name)
    return leaked


def slot_factors(usage: Tensor, weight: float, bias: str = "any") -> Tensor:
    """w_k * u_{k,b,h} per block and slot, (blocks, H + 1): slot H is W_out's bias, weighted by the `bias` rule.

    "any": w_k where the site uses any head of the block (per-site splits); "mean": w_k * mean_h u_{k,b,h}
    (learned heads' soft usages).
    """
    usage = usage.to(torch.float64)
    if bias == "mean":
        bias_usage = usage.mean(dim=1, keepdim=True)
    else:
        bias_usage = usage.amax(dim=1, keepdim=True).ne(0).to(torch.float64)
    return torch.cat([usage, bias_usage], dim=1) * weight


def element_factors(specs: Mapping[str, TensorSpec], config: ModelConfig, factors: Tensor) -> dict[str, Tensor]:
    """Per element of each global-branch per-head tensor of `specs`: its slot's factor (from `slot_factors`).

    A secure round's site multiplies those tensors by these instead of by w_k, and sends `factors`
    itself under the same masks (HEAD_WEIGHTS), so the coordinator learns each head's weighted sum
    and weight sum, never a site's usage.
    """
    out = {}
    for name, block in _head_names(specs).items():
        shape = specs[name].shape
        out[name] = factors[block][element_slots(name, config, 0, math.prod(shape))].view(shape)
    return out


class HeadSplitAverage(ServerAggregator):
    """theta^g_t of a study with per-site head splits: per-head weights w_k * u_{k,b,h}, renormalised per head.

    `usages[i]` is the (blocks, H) usage of the i-th update added (the coordinator's order: by site
    name). Every other tensor is summed exactly as ServerAggregator sums it; memory stays one model
    of sums plus theta^g_{t-1} in `previous`, whatever the number of sites. With `branch="local"`
    and usages 1 - u it averages the sites' local heads instead (the runner's phi_k-averaged reading).
    `bias` weighs W_out's bias: "any" w_k where the site uses any head of the block (per-site splits),
    "mean" w_k * mean_h u_{k,b,h} (learned heads' soft usages, shared/algorithms/learned_heads.py).
    """

    def __init__(
        self,
        config: ModelConfig,
        usages: Sequence[Tensor],
        branch: str = "global",
        bias: str = "any",
        min_slot_weight: float = 0.0,
    ) -> None:
        super().__init__()
        if branch not in ("global", "local"):
            raise AggregationError(f"branch must be 'global' or 'local', got {branch!r}")
        if bias not in ("any", "mean"):
            raise AggregationError(f"bias must be 'any' or 'mean', got {bias!r}")
        self.config, self.branch, self.bias = config, branch, bias
        self.usages = [u.to(torch.float64) for u in usages]
        for usage in self.usages:
            if tuple(usage.shape) != (config.n_blocks, config.n_heads) or not bool(((usage >= 0) & (usage <= 1)).all()):
                raise AggregationError(f"a head usage must be ({config.n_blocks}, {config.n_heads}) values in [0, 1]")
        self._blocks: dict[str, int] = {}  # name -> block, of the per-head tensors of the updates
        self._slot_weights = torch.zeros(config.n_blocks, config.n_heads + 1, dtype=torch.float64)
        self.previous = WeightedAverage()
        self.min_slot_weight = min_slot_weight  # a head summed to at most this keeps theta^g_{t-1} (secure: > 0)

    def run_key(self, name: str) -> Hashable:
        """A per-head tensor is a run of its own, so no piece of the plain sums reaches into it."""
        return ("head", name) if HEAD_TENSOR.match(name) else super().run_key(name)

    def _slot_factors(self, update: int, weight: float) -> Tensor:
        """w_k * u_{k,b,h} per block and slot of the `update`-th update added."""
        return slot_factors(self.usages[update], weight, self.bias)

    @contextmanager
    def adding(
        self, specs: Mapping[str, TensorSpec], weights: Sequence[float], order: Sequence[str] | None = None
    ) -> Iterator[Callable[[Iterable[AlignedPiece]], None]]:
        """As WeightedAverage.adding; the per-head tensors' elements take w_k * u_{k,b,h}."""
        first_update = self.count
        if first_update + len(weights) > len(self.usages):
            raise AggregationError(f"{first_update + len(weights)} updates but head usages of {len(self.usages)} sites")
        factors = [self._slot_factors(first_update + i, w) for i, w in enumerate(weights)]
        self._blocks = _head_names(specs, self.branch)
        with super().adding(specs, weights, order) as accumulate:

            def split(pieces: Iterable[AlignedPiece]) -> None:
                plain = []
                for piece in pieces:
                    if piece[0] in self._blocks:
                        self._add_head_piece(piece, factors, first=first_update == 0)
                    else:
                        plain.append(piece)
                accumulate(plain)

            yield split
        for factor in factors:  # one update at a time, in order: the same totals however they arrive
            self._slot_weights += factor

    def _add_head_piece(self, piece: AlignedPiece, factors: Sequence[Tensor], *, first: bool) -> None:
        name, start, values = piece
        if len(values) != len(factors):
            raise AggregationError(f"a piece of {name!r} holds {len(values)} updates, expected {len(factors)}")
        total = self._flat[name][start : start + values[0].numel()]
        slots = element_slots(name, self.config, start, values[0].numel())
        block = self._blocks[name]
        for index, (update, factor) in enumerate(zip(values, factors, strict=True)):
            per_element = factor[block].to(total.dtype)[slots]
            if first and index == 0:
                torch.mul(update, per_element, out=total)
            else:
                total.addcmul_(update, per_element)

    def take_sums(
        self, specs: Mapping[str, TensorSpec], sums: Mapping[str, Tensor], total_weight: float, count: int
    ) -> None:
        """A secure round's sums: HEAD_WEIGHTS holds Σ_k w_k u_{k,b,h} per slot, the per-head tensors Σ_k of theirs.

        A head whose summed weight is at most `min_slot_weight` keeps theta^g_{t-1}'s value.
        """
        if HEAD_WEIGHTS not in sums:
            raise AggregationError(f"a secure round of a per-head average must sum {HEAD_WEIGHTS}")
        weights = sums[HEAD_WEIGHTS].to(torch.float64).reshape(self.config.n_blocks, self.config.n_heads + 1)
        rest = {name: spec for name, spec in specs.items() if name != HEAD_WEIGHTS}
        super().take_sums(rest, SumsView(sums, rest), total_weight, count)
        self._blocks = _head_names(rest, self.branch)
        self._slot_weights = weights.clone()

    def result(self) -> TensorDict:
        """Every other tensor's plain average; each head's over the sites that hold it, else theta^g_{t-1}'s."""
        out = super().result()
        if not self._blocks:
            return out
        if self.previous is None or self.previous.count != 1:
            raise AggregationError("a per-head average needs theta^g_{t-1} added to `previous` exactly once")
        previous = self.previous.result()
        for name, block in self._blocks.items():
            total = self._sums[name]
            divisor = self._slot_weights[block][element_slots(name, self.config, 0, total.numel())].view(total.shape)
            mean = (total / divisor.clamp_min(torch.finfo(torch.float64).tiny)).to(self._dtypes[name])
            out[name] = torch.where(divisor > self.min_slot_weight, mean, previous[name])
        return out
