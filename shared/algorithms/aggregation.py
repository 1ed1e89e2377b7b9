"""Server-side aggregation math: a weighted average of name-keyed tensors, fed a few updates at a time.

The site weights w_k it is given come from the study's weighting (shared/algorithms/weightings.py).

Pure functions over name-keyed tensors: the coordinator feeds it stored uploads, the in-process
experiment runner feeds it in-memory states. Memory is one model's worth whatever the number of
sites, because each update is added in place and may be dropped before the next one is read.

Rule for non-floating tensors (BatchNorm's `num_batches_tracked`, any bool or integer buffer):
the result is the element-wise maximum over the updates. A count of steps has no meaningful
weighted mean; the maximum is exact, monotone across rounds, and what the longest-trained site saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from shared.errors import AggregationError
from shared.tensors.codec import TensorSpec, schema_of
from shared.tensors.sum_buffers import sum_buffers
from shared.tensors.windows import tensor_runs

__all__ = ["AlignedPiece", "SumsView", "WeightedAverage", "weighted_average"]

TensorDict = dict[str, Tensor]
AlignedPiece = tuple[str, int, Sequence[Tensor]]  # (name, first element, the same piece of each update)


class SumsView(Mapping[str, Tensor]):
    """Sums held elsewhere, by the names of `specs` (each in `sums`), each shaped as its spec when looked up."""

    def __init__(self, sums: Mapping[str, Tensor], specs: Mapping[str, TensorSpec]) -> None:
        self._sums, self._specs = sums, specs

    def __getitem__(self, name: str) -> Tensor:
        return self._sums[name].reshape(self._specs[name].shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


class WeightedAverage:
    """Σ_k w_k θ_k / Σ_k w_k over name-keyed tensors, accumulated one update (or a few) at a time.

    Floating tensors accumulate in place (`acc.add_(t, alpha=w)`) in float32, or float64 for
    float64 inputs, and come back in their own dtype. Other tensors take the element-wise maximum
    (see the module docstring). The updates may be read-only views of stored bytes: they are only read.

    The sums lie in flat buffers, one per run of neighbouring tensors (in the first update's order)
    that share a dtype and a `run_key`, so a stored update laid out in that same order can be added
    a window of many tensors at a time (shared.tensors.windows.tensor_pieces with `run_key`). Each element
    is summed over the updates in the order they were given, whichever way they arrive: whole, in
    pieces, or several side by side; all ways give bit-identical results. The buffers are reused
    by later averages once this one is garbage (shared.tensors.sum_buffers): `result` returns copies.
    """

    def __init__(self) -> None:
        self._sums: Mapping[str, Tensor] = {}  # each sum, shaped as its tensor (taken sums: read when used)
        self._flat: TensorDict = {}  # each sum as 1-D, from its first element on to the end of its run
        self._dtypes: dict[str, torch.dtype] = {}
        self._weighted: dict[str, bool] = {}
        self._order: tuple[str, ...] = ()
        self._total_weight = 0.0
        self.count = 0

    @property
    def total_weight(self) -> float:
        """Σ_k w_k of the updates added so far (or of the sums taken)."""
        return self._total_weight

    def weighs(self, name: str) -> bool:
        """Whether tensor `name` is summed with the updates' weights (True) or with weight 1 each."""
        return True

    def run_key(self, name: str) -> Hashable:
        """Neighbouring tensors of one dtype and one key share a flat buffer of sums (see the class)."""
        return self.weighs(name)

    def lays_out_like(self, order: Sequence[str]) -> bool:
        """Whether the sums lie in the order `order`, so pieces cut with `run_key` may be added."""
        return tuple(order) == self._order

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Add one update with weight `weight` (>= 0); every update must have the same names and shapes."""
        pieces = ((name, 0, tensor.reshape(-1)) for name, tensor in tensors.items())
        self.add_pieces(schema_of(tensors), pieces, weight)

    def add_pieces(
        self, specs: Mapping[str, TensorSpec], pieces: Iterable[tuple[str, int, Tensor]], weight: float
    ) -> None:
        """Add one update that arrives as flat pieces `(name, first element, 1-D values)`.

        `specs` names the update's tensors; the pieces must cover each of them exactly once (as
        shared.tensors.windows.tensor_pieces yields them), so a stored update is added while it is read and
        is never whole in memory. An error midway leaves this average unusable.
        """
        with self.adding(specs, [weight]) as accumulate:
            accumulate((name, start, (values,)) for name, start, values in pieces)

    @contextmanager
    def adding(
        self, specs: Mapping[str, TensorSpec], weights: Sequence[float], order: Sequence[str] | None = None
    ) -> Iterator[Callable[[Iterable[AlignedPiece]], None]]:
        """Add `len(weights)` updates of schema `specs` side by side: yields `accumulate(pieces)`.

        Each piece `(name, first element, values)` holds one 1-D tensor per update, in the order of
        `weights`; together the pieces must cover every tensor exactly once. `accumulate` may run in
        several threads at once on disjoint pieces. `order` is the updates' payload order, which the
        first update's sums take (default: the order of `specs`). The updates count once the block
        ends without an error; an error midway leaves this average unusable.
        """
        if not weights or not all(math.isfinite(w) and w >= 0 for w in weights):
            raise AggregationError(f"weights must be finite and >= 0, got {list(weights)}")
        if isinstance(self._sums, SumsView):
            raise AggregationError("an average that took sums takes no update")
        first = self.count == 0
        if first:
            self._allocate(specs, tuple(order if order is not None else specs))
        else:
            self._check(specs)
        unit = [1.0] * len(weights)

        def accumulate(pieces: Iterable[AlignedPiece]) -> None:
            for name, start, values in pieces:
                if len(values) != len(weights):
                    raise AggregationError(f"a piece of {name!r} holds {len(values)} updates, expected {len(weights)}")
                total = self._flat[name][start : start + values[0].numel()]
                floating, factors = total.is_floating_point(), weights if self._weighted[name] else unit
                for index, (update, factor) in enumerate(zip(values, factors, strict=True)):
                    if first and index == 0:
                        torch.mul(update, factor, out=total) if floating else total.copy_(update)
                    elif floating:
                        total.add_(update, alpha=factor)
                    else:
                        torch.maximum(total, update, out=total)

        yield accumulate
        for weight in weights:  # one at a time, as `add` would: the same total to the last bit
            self._total_weight += weight
        self.count += len(weights)

    def take_sums(
        self, specs: Mapping[str, TensorSpec], sums: Mapping[str, Tensor], total_weight: float, count: int
    ) -> None:
        """Start from sums of `count` updates accumulated elsewhere (a secure round's unmasked sum).

        Floating tensors hold Σ_k w_k θ_k (Σ_k θ_k where `weighs` is False), in any floating dtype;
        other tensors hold their final value, returned as it is. `specs` gives the result's dtypes.
        The sums are read as `result` needs them, a tensor at a time, never copied (a model's float64
        sums are twice its size): `sums` may decode each one when looked up (shared.study.secagg),
        and must stay valid, unchanged, until the result is taken.
        """
        if self.count:
            raise AggregationError("only an empty average takes sums")
        if count < 1 or not math.isfinite(total_weight) or total_weight <= 0:
            raise AggregationError(f"sums of {count} updates of total weight {total_weight} cannot be averaged")
        if sums.keys() != specs.keys():
            raise AggregationError(f"sums {sorted(sums)} do not match the schema {sorted(specs)}")
        self._sums, self._flat = SumsView(sums, specs), {}
        self._dtypes = {name: spec.dtype for name, spec in specs.items()}
        self._weighted = {name: self.weighs(name) for name in specs}
        self._order, self._total_weight, self.count = tuple(specs), total_weight, count

    def _allocate(self, specs: Mapping[str, TensorSpec], order: tuple[str, ...]) -> None:
        if set(order) != specs.keys() or len(order) != len(specs):
            raise AggregationError("the payload order must name every tensor of the update once")
        sums: TensorDict = {}
        self._sums, self._flat, self._order = sums, {}, order
        self._dtypes = {name: spec.dtype for name, spec in specs.items()}
        self._weighted = {name: self.weighs(name) for name in specs}
        for run in tensor_runs(order, specs, self.run_key):
            numel = sum(specs[name].numel for name in run)
            buffer = sum_buffers.take(self, numel, _sum_dtype(specs[run[0]].dtype))  # back once this is garbage
            offset = 0
            for name in run:
                self._flat[name] = buffer[offset:]
                sums[name] = buffer[offset : offset + specs[name].numel].view(specs[name].shape)
                offset += specs[name].numel
        for name in specs.keys() - sums.keys():  # empty tensors
            sums[name] = torch.empty(specs[name].shape, dtype=_sum_dtype(specs[name].dtype))
            self._flat[name] = sums[name].view(-1)

    def _check(self, specs: Mapping[str, TensorSpec]) -> None:
        if specs.keys() != self._sums.keys():
            missing, extra = self._sums.keys() - specs.keys(), specs.keys() - self._sums.keys()
            raise AggregationError(f"update names differ from the first update's: missing {missing}, extra {extra}")
        for name, spec in specs.items():
            total = self._sums[name]
            if spec.shape != tuple(total.shape) or spec.dtype != self._dtypes[name]:
                raise AggregationError(
                    f"tensor {name!r} is {spec.dtype}{list(spec.shape)}, expected "
                    f"{self._dtypes[name]}{list(total.shape)}"
                )

    def result(self) -> TensorDict:
        """The average so far, each tensor in its input dtype."""
        if self.count == 0:
            raise AggregationError("no update was added")
        if self._total_weight <= 0:
            raise AggregationError("the weights of the added updates sum to zero")
        out: TensorDict = {}
        for name, total in self._sums.items():
            if total.is_floating_point():
                out[name] = _quotient(total, self._total_weight, self._dtypes[name])
            else:
                out[name] = total.clone()
        return out


QUOTIENT_WINDOW = 1 << 20  # elements divided at a time: no whole temporary of a sum's dtype beside the result


def _quotient(total: Tensor, divisor: float, dtype: torch.dtype) -> Tensor:
    """`(total / divisor).to(dtype)`, the same bits, computed a window at a time into the result."""
    out = torch.empty(total.shape, dtype=dtype)
    flat_out, flat = out.view(-1), total.reshape(-1)
    for first in range(0, flat.numel(), QUOTIENT_WINDOW):
        window = slice(first, first + QUOTIENT_WINDOW)
        flat_out[window] = flat[window] / divisor
    return out


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` is summed in: float64 stays, other floats take float32, the rest stay."""
    if dtype.is_floating_point and dtype != torch.float64:
        return torch.float32
    return dtype


def weighted_average(updates: Iterable[tuple[Mapping[str, Tensor], float]]) -> TensorDict:
    """Weighted average of (tensors, weight) pairs, consuming the iterable one update at a time."""
    average = WeightedAverage()
    for tensors, weight in updates:
        average.add(tensors, weight)
    return average.result()
