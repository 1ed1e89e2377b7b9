"""A study's secure aggregation: a site's ring vector, and the decoded sums (each round's setup: secure_setup.py).

The one path the coordinator, the site agent and the in-process runner share
(docs/architecture/overview.md, Layout: the math lives once), so a secure study gives the same
theta^g bit for bit in the service and the runner:

- `SecureLayout`: where everything lies in one site's vector, two sections. In Z_{2^32} (with
  `ring_bits = 32`, the default): the tensors the server averages with the weights w_k, as their
  change from theta^g, w_k (theta_k - theta^g) in fixed point; the sum of K of them stays within
  2^(30 - f) because the weights sum to at most 1 (quantize.FixedPoint), and it is half the bytes
  of Z_{2^64}. In Z_{2^64}, in this order (the site's own weight w_k after the loss sum, so the
  survivors' weight sum is unmasked with the rest): the upload schema's other tensors flattened in
  sorted-name order, in fixed point (`fraction_bits` f, default 24), times w_k, or times 1 where
  the algorithm's server sums a tensor unweighted
  (Scaffold's Delta c: `weighs`), or times per-element factors the caller gives (per-head weights
  w_k u_{k,b,h}: shared/study/rules.py `secure_site_vector`); the site's evaluation loss sum (fixed
  point, unweighted) and its weight w_k (fixed point); then integer counts, exact: whether it
  reported evaluation statistics, whether it had too few records, n_samples, TP, FP, FN per class
  and the per-class score histograms of positives and negatives.
- `site_vector` encodes one site's part; `decode_sum` reads the unmasked sum back: the sums the
  algorithm's server step takes (shared/study/server_round.py `server_round_from_sums`: the weighted average
  over the survivors' weight sum, so weights are renormalised over the survivors; Scaffold's step
  with Sum_k Delta c_k; central DP noise for the survivors' count), and the pooled evaluation
  statistics, which no site sent in the clear.

Quantisation: each coordinate of w_k theta_k, w_k (theta_k - theta^g) or Delta c_k is rounded to a multiple of 2^-f, so
the decoded sum of K survivors is within K * 2^-(f+1) of the exact sum per coordinate, and the
average within K * 2^-(f+1) / sum_S w_k (FixedPoint.error_bound); Scaffold moves theta^g by
server_lr times the average and c by the Delta c sum over N; counts are exact.

Integer buffers (BatchNorm's `num_batches_tracked`): the plain aggregation takes their maximum,
which a masked sum cannot give. Under secure aggregation they are averaged like every other
tensor (weighted by w_k, renormalised over the survivors) and rounded half to even.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from shared.errors import MetricsError, PrivacyInputError
from shared.evaluation.metrics import N_BINS, TOO_FEW_RECORDS, EvalStats, Summary
from shared.evaluation.summaries import summary_of_total
from shared.privacy.errors import ValueOutOfRange
from shared.privacy.masking import RingVector, ring_sections, ring_shape
from shared.privacy.quantize import COUNTS, FixedPoint
from shared.study.vectors import TensorLayout
from shared.tensors.codec import TensorSpec
from shared.tensors.windowed import flat_window

__all__ = ["SecureLayout", "SecureSumDecoded", "decode_sum", "site_vector", "survivor_weight_sum"]

_FLAGS = 3  # reported, too few records, n_samples


@dataclass(frozen=True)
class SecureLayout:
    """Where the weighted tensors, the loss sum and the integer statistics lie in one site's two ring sections."""

    tensors: TensorLayout  # the upload schema, sorted by name (empty in the final evaluation round)
    n_classes: int
    fixed_point: FixedPoint  # the Z_{2^64} section's
    weighted: tuple[bool, ...]  # per tensor: times w_k (True) or summed with weight 1 (the server's `weighs`)
    narrow: tuple[bool, ...]  # per tensor: in Z_{2^32} as its change from theta^g

    @classmethod
    def of(
        cls,
        schema: Mapping[str, TensorSpec],
        n_classes: int,
        fraction_bits: int,
        weighs: Callable[[str], bool] | None = None,
        narrow: Callable[[str], bool] | None = None,
    ) -> SecureLayout:
        """The layout of a round whose uploads follow `schema`; {} for evaluation only; `weighs` as the server's.

        `narrow` picks the tensors summed in Z_{2^32} as their change from theta^g; only floating
        tensors weighted by w_k can be (the range argument needs factors that sum to at most 1).
        """
        names = tuple(sorted(schema))
        tensors = TensorLayout(
            names, tuple(tuple(schema[n].shape) for n in names), tuple(schema[n].dtype for n in names)
        )
        weighted = tuple(weighs(n) for n in names) if weighs is not None else (True,) * len(names)
        chosen = tuple(narrow(n) for n in names) if narrow is not None else (False,) * len(names)
        for name, is_narrow, weighs_it in zip(names, chosen, weighted, strict=True):
            if is_narrow and not (weighs_it and schema[name].dtype.is_floating_point):
                raise PrivacyInputError(f"{name}: only floating tensors weighted by w_k are summed in Z_{{2^32}}")
        return cls(tensors, n_classes, FixedPoint(fraction_bits), weighted, chosen)

    @property
    def narrow_fixed_point(self) -> FixedPoint:
        """The Z_{2^32} section's encoding: the same fraction bits, the range of a change from theta^g."""
        return FixedPoint(self.fixed_point.fraction_bits, ring_bits=32)

    @property
    def schema(self) -> dict[str, TensorSpec]:
        """Name -> spec of the summed tensors, in layout order."""
        return {
            n: TensorSpec(shape, dtype)
            for n, shape, dtype in zip(self.tensors.names, self.tensors.shapes, self.tensors.dtypes, strict=True)
        }

    @property
    def narrow_names(self) -> tuple[str, ...]:
        """The tensors summed in Z_{2^32}, in layout order."""
        return tuple(n for n, is_narrow in zip(self.tensors.names, self.narrow, strict=True) if is_narrow)

    @property
    def narrow_length(self) -> int:
        """Number of uint32 words of a site's Z_{2^32} section."""
        return sum(size for size, is_narrow in zip(self.tensors.sizes, self.narrow, strict=True) if is_narrow)

    @property
    def wide_tensors_length(self) -> int:
        """Where the Z_{2^64} section's scalars begin: the words of its tensors."""
        return self.tensors.length - self.narrow_length

    @property
    def wide_length(self) -> int:
        """Number of uint64 words of a site's Z_{2^64} section: the other tensors, the scalars, the statistics."""
        return self.length - self.narrow_length

    @property
    def length(self) -> int:
        """Number of ring elements of a site's vector, both sections."""
        return self.tensors.length + 2 + _FLAGS + 3 * self.n_classes + 2 * self.n_classes * N_BINS

    def places(self) -> list[tuple[str, int, bool, bool, int]]:
        """(name, size, weighted, narrow, start in its section) of each tensor, in layout order."""
        starts, out = [0, 0], []
        for name, size, weighs, is_narrow in zip(
            self.tensors.names, self.tensors.sizes, self.weighted, self.narrow, strict=True
        ):
            out.append((name, size, weighs, is_narrow, starts[is_narrow]))
            starts[is_narrow] += size
        return out

    def empty(self) -> tuple[np.ndarray, np.ndarray]:
        """An uninitialised (Z_{2^32}, Z_{2^64}) pair of sections of this layout."""
        return np.empty(self.narrow_length, dtype=np.uint32), np.empty(self.wide_length, dtype=np.uint64)

    def sections_of(self, ring: RingVector) -> tuple[np.ndarray, np.ndarray]:
        """(Z_{2^32}, Z_{2^64}) sections of `ring`, checked against this layout."""
        sections, shapes = ring_sections(ring), ring_shape(ring)
        if shapes != [("uint32", self.narrow_length), ("uint64", self.wide_length)]:
            raise PrivacyInputError(
                f"a ring vector of sections {shapes} does not fit a layout of {self.narrow_length} uint32 and "
                f"{self.wide_length} uint64 words"
            )
        return sections[0], sections[1]


def _counts(eval_stats: Mapping[str, Any] | None, n_classes: int) -> tuple[np.ndarray, float]:
    """(integer statistics in layout order, loss sum) of one site's report (None: nothing reported)."""
    counts = np.zeros(_FLAGS + 3 * n_classes + 2 * n_classes * N_BINS, dtype=np.int64)
    if eval_stats is None:
        return counts, 0.0
    counts[0] = 1
    if eval_stats.get(TOO_FEW_RECORDS):
        counts[1] = 1
        return counts, 0.0
    stats = EvalStats.from_dict(dict(eval_stats))
    if stats.n_classes != n_classes:
        raise MetricsError(f"eval_stats has {stats.n_classes} classes, the study's model has {n_classes}")
    counts[2] = stats.n_samples
    parts = [stats.tp, stats.fp, stats.fn, stats.pos_hist.reshape(-1), stats.neg_hist.reshape(-1)]
    counts[_FLAGS:] = np.concatenate(parts)
    return counts, stats.loss_sum


def site_vector(
    layout: SecureLayout,
    shared: Mapping[str, Tensor],
    weight: float,
    eval_stats: Mapping[str, Any] | None,
    out: RingVector | None = None,
    factors: Mapping[str, Tensor] | None = None,
    base: Mapping[str, Tensor] | None = None,
    grid: Mapping[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One site's unmasked ring vector, as (Z_{2^32}, Z_{2^64}) sections.

    In Z_{2^32}: w_k (theta_k - theta^g) of the layout's narrow tensors (`base` is theta^g); in
    Z_{2^64}: w_k theta_k of the others (or 1 x, where the server sums unweighted), the loss sum and
    w_k, then the statistics exactly. The site's own weight w_k is summed with the vectors, so the
    coordinator divides by the survivors' weight sum without being told any one weight (nor choosing it).

    `out`, the two sections (e.g. views into the upload's body), receives it.
    `factors` gives some tensors one factor per element in place of w_k (per-head weights w_k u_{k,h}).
    `grid` (differential privacy) gives narrow tensors' changes already in grid steps, summed as they
    are with factor 1 (the caller's weight is then 1: the server divides by the survivors' count).
    """
    if TensorLayout.of(shared) != layout.tensors:
        raise PrivacyInputError("the tensors to sum do not match the study's upload schema")
    counts, loss_sum = _counts(eval_stats, layout.n_classes)
    narrow, wide = layout.sections_of(layout.empty() if out is None else out)
    for name, size, weighs, is_narrow, start in layout.places():
        values = _numpy_values(shared[name])
        factor = _numpy_values(factors[name]) if factors and name in factors else weight if weighs else 1.0
        if grid is not None and name in grid:
            if not is_narrow or grid[name].size != size:
                raise PrivacyInputError(f"{name}'s change on the grid does not fit the layout's Z_{{2^32}} section")
            _write_steps(grid[name], narrow[start : start + size], layout.narrow_fixed_point)
        elif is_narrow:
            if base is None or name not in base or tuple(base[name].shape) != tuple(shared[name].shape):
                raise PrivacyInputError(f"{name} is summed as its change from theta^g, which lacks it")
            offset = _numpy_values(base[name])
            layout.narrow_fixed_point.encode_into(values, narrow[start : start + size], factor, base=offset)
        else:
            layout.fixed_point.encode_into(values, wide[start : start + size], factor)
    tail = layout.wide_tensors_length
    wide[tail : tail + 2] = layout.fixed_point.encode(np.array([loss_sum, weight]))
    wide[tail + 2 :] = COUNTS.encode_counts(counts)
    return narrow, wide


def _write_steps(steps: np.ndarray, out: np.ndarray, encoding: FixedPoint) -> None:
    """Integer grid steps into Z_{2^32} words (two's complement); ValueOutOfRange past the encoding's range."""
    limit = encoding.max_abs * encoding.scale
    if steps.size and not (-limit <= int(steps.min()) and int(steps.max()) <= limit):
        raise ValueOutOfRange(
            f"values in [{int(steps.min()) / encoding.scale:.6g}, {int(steps.max()) / encoding.scale:.6g}] "
            f"exceed {encoding.max_abs:.6g}"
        )
    out[...] = steps.astype(np.int32).view(np.uint32)


def _numpy_values(tensor: Tensor) -> np.ndarray:
    """A tensor's values as a flat NumPy array without a float64 copy where NumPy reads its dtype."""
    flat = tensor.detach().cpu().reshape(-1)
    if flat.dtype == torch.bfloat16:  # the one floating dtype NumPy has no view of
        flat = flat.double()
    return flat.numpy()


@dataclass(frozen=True, eq=False)
class SecureSumDecoded:
    """The unmasked sum read back: the sums the server step takes, and the pooled evaluation statistics."""

    schema: dict[str, TensorSpec]  # the summed tensors (empty in the final evaluation round)
    sums: Mapping[str, Tensor]  # floating: sum_S w_k theta_k (or sum_S theta_k, unweighted) in float64; others final
    weight_sum: float  # sum_S w_k over the survivors
    survivors: int
    pooled_eval: Summary | None  # None when no survivor reported statistics
    error_bound: float  # per coordinate of a weighted average sum / weight_sum, from the fixed-point rounding


DECODE_WINDOW = 1 << 20  # values per step where a decoded sum meets theta^g (8 MiB of float64)


def survivor_weight_sum(weights: Mapping[str, float], survivors: Sequence[str]) -> float:
    """Sum over the survivors of w_k (exactly rounded, whatever the order)."""
    return math.fsum(weights[site] for site in survivors)


def decode_sum(
    layout: SecureLayout, ring_sum: RingVector, survivors: int, base: Mapping[str, Tensor] | None = None
) -> SecureSumDecoded:
    """Read the survivors' unmasked ring sum: floating sums in float64, integer tensors' weighted mean rounded.

    The survivors' weight sum W is read from the ring too (each site added its own w_k). The narrow
    tensors' sum is of w_k (theta_k - theta^g): W theta^g (`base`) is added back, so every sum is
    sum_S w_k theta_k. Integer buffers (BatchNorm's step counts) take the maximum in a plain round,
    which a masked sum cannot give: here they are averaged over the weight sum and rounded half to even.
    The sums are decoded a tensor at a time, when looked up (DecodedSums): `ring_sum` and `base` must
    stay valid, unchanged, while they are read.
    """
    narrow, wide = layout.sections_of(ring_sum)
    split = layout.wide_tensors_length
    loss_sum, weight_sum = (float(v) for v in layout.fixed_point.decode(wide[split : split + 2]))
    if layout.tensors.length and not weight_sum > 0:
        raise PrivacyInputError(f"the survivors' weights sum to {weight_sum}: nothing to average")
    narrow_names = set(layout.narrow_names)
    if narrow_names and (base is None or not narrow_names <= base.keys()):
        missing = sorted(narrow_names - (base.keys() if base is not None else set()))
        raise PrivacyInputError(f"{', '.join(missing)} was summed as its change from theta^g, which is not given")
    sums = DecodedSums(layout, narrow, wide, weight_sum, base)
    counts = COUNTS.decode_counts(wide[split + 2 :])
    bound = layout.fixed_point.error_bound(survivors) / weight_sum if layout.tensors.length else 0.0
    pooled = _pooled(counts, loss_sum, layout.n_classes)
    return SecureSumDecoded(layout.schema, sums, weight_sum, survivors, pooled, bound)


class DecodedSums(Mapping[str, Tensor]):
    """The sums of a decoded ring sum by tensor name, each decoded anew when looked up: one held at a time."""

    def __init__(
        self,
        layout: SecureLayout,
        narrow: np.ndarray,
        wide: np.ndarray,
        weight_sum: float,
        base: Mapping[str, Tensor] | None,
    ) -> None:
        self._layout, self._narrow, self._wide, self._weight_sum, self._base = layout, narrow, wide, weight_sum, base
        self._places = {
            place[0]: (place, shape, dtype)
            for place, shape, dtype in zip(layout.places(), layout.tensors.shapes, layout.tensors.dtypes, strict=True)
        }

    def __getitem__(self, name: str) -> Tensor:
        (_, size, weighs, is_narrow, start), shape, dtype = self._places[name]
        if is_narrow:
            words, encoding = self._narrow[start : start + size], self._layout.narrow_fixed_point
        else:
            words, encoding = self._wide[start : start + size], self._layout.fixed_point
        piece = torch.from_numpy(encoding.decode(words)).reshape(shape)
        if is_narrow:
            assert self._base is not None  # decode_sum checked it holds every narrow tensor
            _add_scaled(piece.view(-1), self._base, name, self._weight_sum)
        elif not dtype.is_floating_point:
            piece = torch.round(piece / self._weight_sum if weighs else piece).to(dtype)
        return piece

    def __iter__(self) -> Iterator[str]:
        return iter(self._places)

    def __len__(self) -> int:
        return len(self._places)


def _add_scaled(out: Tensor, tensors: Mapping[str, Tensor], name: str, scale: float) -> None:
    """Out += scale * tensors[name] in float64, a window at a time: neither tensor copied whole."""
    for first in range(0, out.numel(), DECODE_WINDOW):
        last = min(first + DECODE_WINDOW, out.numel())
        out[first:last].add_(flat_window(tensors, name, first, last).to(torch.float64), alpha=scale)


def _pooled(counts: np.ndarray, loss_sum: float, n_classes: int) -> Summary | None:
    reported, too_few, n_samples = (int(v) for v in counts[:_FLAGS])
    if reported == 0:
        return None
    pooled = reported - too_few
    if pooled == 0:
        return summary_of_total(None, 0, too_few)
    c, h = n_classes, n_classes * N_BINS
    body = counts[_FLAGS:]
    tp, fp, fn = body[:c], body[c : 2 * c], body[2 * c : 3 * c]
    pos = body[3 * c : 3 * c + h].reshape(c, N_BINS)
    neg = body[3 * c + h :].reshape(c, N_BINS)
    total = EvalStats(n_samples, max(loss_sum, 0.0), tp, fp, fn, pos, neg)
    return summary_of_total(total, pooled, too_few)
