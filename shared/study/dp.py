"""A study's client-level DP: the update a site releases, the discrete noise on the sum, and the epsilon spent.

DP-FedAvg (McMahan et al., ICLR 2018) over the floating-point tensors of the shared schema (model
parameters and BatchNorm statistics alike: both are learned from the site's records), on the
fixed-point grid 2^-f (f the secure aggregation's fraction_bits, else GRID_BITS = 24):

- a site clips its change theta_k - theta^g_{t-1} to L2 norm C and puts it on the grid, so its
  change in grid steps has norm at most Delta = C 2^f + ceil(sqrt d) / 2 (d the values it covers;
  `norm_bound`): under secure aggregation by conditional randomized rounding (shared/privacy/
  discrete.py), summed exactly in Z_{2^32}; in a plain round the coordinator reads the change back
  from the uploaded tensors as rint((theta_k - theta^g_{t-1}) 2^f) (`grid_change`), and the site
  releases tensors whose read-back change it has checked against the same bound;
- the noise is the discrete Gaussian N_Z(0, sigma^2) per coordinate of the integer sum, sigma =
  z Delta (`sum_noise_variance`), sampled exactly from the operating system's randomness: in
  "central" mode the coordinator adds it (`CentralNoiseAverage` in a plain round, `add_ring_noise`
  to a secure round's unmasked sum); in "distributed" mode, which needs secure aggregation, each
  site adds N_Z(0, sigma^2 / h) itself, h the honest sites among the round's quorum
  (`honest_quorum`: the quorum less the c sites that may collude with the coordinator, whose shares
  it would know), so the honest shares alone sum to a variance of at least sigma^2;
- the released theta^g_t = theta^g_{t-1} + (sum + noise) 2^-f / n divides by the public count n
  (DP studies weight sites equally), so the neighbouring relation is replace-one (`RELATION`): one
  site's records replaced by any others move the integer sum by at most 2 Delta in L2 norm;
- accounting: shared/study/accounting.py (the discrete Gaussian's RDP, CKS 2020 and Kairouz,
  Liu and Steinke 2021, composed over the rounds with sampling rate 1).

Integer tensors (BatchNorm's step counters) are released as they are. `NOISE_SOURCE` is what the
coordinator, the sites and the in-process runner draw from, so a test can inject one seeded source
into all of them. Its key comes from the OS, except inside `seeded_noise`: the in-process runner draws
each (round, site)'s and each release's noise from keys derived from the study's seed there, so that a
simulated DP study gives the same numbers in any process and any order (a simulation's noise, never the
service's).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from shared.algorithms.aggregation import AlignedPiece, WeightedAverage
from shared.algorithms.server import ServerAggregator
from shared.errors import AggregationError, PrivacyInputError
from shared.privacy.discrete import DiscreteGaussian, conditional_round, squared_norm_within, squares_within
from shared.tensors.codec import TensorSpec
from shared.tensors.windows import tensor_runs

if TYPE_CHECKING:
    from shared.terms import DifferentialPrivacy, StudyTerms

__all__ = [
    "GRID_BITS",
    "MECHANISM",
    "NOISE_SOURCE",
    "RELATION",
    "CentralNoiseAverage",
    "DpRelease",
    "add_ring_noise",
    "dp_dimension",
    "dp_fraction_bits",
    "grid_change",
    "honest_quorum",
    "noise_source",
    "seeded_noise",
    "norm_bound",
    "release_update",
    "ring_range_problem",
    "sum_noise_variance",
]

# makes each draw's source from a key (None: one from the OS); a test may swap it
NOISE_SOURCE: Callable[[bytes | None], DiscreteGaussian] = DiscreteGaussian
RELATION = "replace-one"  # neighbouring studies: one site's records replaced by any others
MECHANISM = "discrete Gaussian"
GRID_BITS = 24  # f of the grid of a DP study without secure aggregation (a secure study's is its fraction_bits)
_CLIP_MARGIN = 1 - 2.0**-30  # clip a hair below C: the float64 norm of the clipped change errs by far less
_FIT_TRIES = 4


@dataclass
class _SeededDraws:
    """The keys of the sources made inside one `seeded_noise`: the label's, then one more per source."""

    label: str
    made: int = 0

    def next_key(self) -> bytes:
        self.made += 1
        return hashlib.sha256(f"cardiofl-simulated-noise|{self.label}|{self.made}".encode()).digest()


_SEEDED: ContextVar[_SeededDraws | None] = ContextVar("cardiofl_seeded_noise", default=None)


@contextmanager
def seeded_noise(label: str) -> Iterator[None]:
    """Inside, each noise source's key derives from `label` (e.g. a study's seed, round and site) and its rank."""
    token = _SEEDED.set(_SeededDraws(label))
    try:
        yield
    finally:
        _SEEDED.reset(token)


def noise_source() -> DiscreteGaussian:
    """A fresh source of discrete Gaussian noise (and rounding bits) for one release: OS-keyed but in `seeded_noise`."""
    draws = _SEEDED.get()
    return NOISE_SOURCE(draws.next_key() if draws is not None else None)


def norm_bound(clip_norm: float, dimension: int, fraction_bits: int) -> Fraction:
    """Delta, in grid steps: C 2^f + ceil(sqrt d) / 2, the most a released change on the grid may measure."""
    root = math.isqrt(dimension)
    root += root * root < dimension
    bound: Fraction = Fraction(clip_norm) * 2**fraction_bits + Fraction(root, 2)
    return bound


def sum_noise_variance(dp: DifferentialPrivacy, dimension: int, fraction_bits: int) -> Fraction:
    """sigma^2 = (z Delta)^2 in grid steps squared: the noise variance per coordinate of the sum."""
    return (Fraction(dp.noise_multiplier) * norm_bound(dp.clip_norm, dimension, fraction_bits)) ** 2


def grid_change(values: Tensor, base: Tensor, fraction_bits: int) -> Tensor:
    """rint((values - base) 2^f) as int64, computed in float64: a released tensor's change read back on the grid."""
    return torch.round((values.double() - base.double()) * 2.0**fraction_bits).to(torch.int64)


def _floating(tensors: Mapping[str, Any]) -> list[str]:
    """The DP-covered names, sorted: every floating-point tensor (specs or tensors)."""
    return sorted(name for name, t in tensors.items() if t.dtype.is_floating_point)


@dataclass(frozen=True)
class DpRelease:
    """What a site releases: the tensors a plain round uploads, and the change on the grid a secure round sums."""

    tensors: dict[str, Tensor]  # theta^g_{t-1} plus the released change, in each tensor's dtype
    grid: dict[str, np.ndarray] = field(default_factory=dict)  # name -> int64 change in grid steps (floating ones)


def release_update(
    trained: Mapping[str, Tensor],
    previous: Mapping[str, Tensor],
    dp: DifferentialPrivacy,
    *,
    fraction_bits: int,
    secure: bool,
    quorum: int = 1,
) -> DpRelease:
    """A site's release: theta^g_{t-1} plus its clipped change on the grid (plus its noise share, distributed).

    `quorum` is h, the honest sites the distributed noise is sized for (`honest_quorum`).
    """
    names = _floating(trained)
    if any(previous[n].shape != trained[n].shape for n in names):
        raise PrivacyInputError("the trained tensors and theta^g_{t-1} differ in shape")
    change = np.concatenate([(trained[n].double() - previous[n].double()).reshape(-1).numpy() for n in names])
    bound = norm_bound(dp.clip_norm, change.size, fraction_bits) ** 2
    norm = float(np.linalg.norm(change))
    if not math.isfinite(norm):
        raise PrivacyInputError("the trained model's change is not finite: nothing to clip")
    scale = min(1.0, dp.clip_norm * _CLIP_MARGIN / norm) if norm > 0 else 1.0
    steps = change * (scale * 2.0**fraction_bits)
    if not secure:
        if dp.mode != "central":
            raise PrivacyInputError("distributed noise needs secure aggregation")
        return _plain_release(trained, previous, names, steps, bound, fraction_bits)
    source = noise_source()
    codes = conditional_round(steps, bound, source)
    if dp.mode == "distributed":
        codes += source.sample(codes.size, sum_noise_variance(dp, codes.size, fraction_bits) / quorum)
    grid = _split(codes, {n: trained[n].numel() for n in names})
    return DpRelease(_moved(trained, previous, grid, fraction_bits), grid)


def _moved(
    tensors: Mapping[str, Tensor],
    base: Mapping[str, Tensor],
    steps: Mapping[str, np.ndarray],
    bits: int,
    count: int = 1,
) -> dict[str, Tensor]:
    """`tensors` with each name of `steps` replaced by base + steps 2^-f / count, in float64, then its own dtype."""
    out = dict(tensors)
    for name, moved in steps.items():
        change = torch.from_numpy(moved.astype(np.float64) * 2.0**-bits / count).reshape(tensors[name].shape)
        out[name] = (base[name].double().reshape(change.shape) + change).to(tensors[name].dtype)
    return out


def _plain_release(
    trained: Mapping[str, Tensor],
    previous: Mapping[str, Tensor],
    names: list[str],
    steps: np.ndarray,
    bound: Fraction,
    fraction_bits: int,
) -> DpRelease:
    """Tensors whose change, read back on the grid as the coordinator will (`grid_change`), is within `bound`.

    Storing theta^g_{t-1} + change in float32 rounds it again, so the read-back change may exceed the
    clipped one by up to about half a grid step per value: the change is shrunk by what that
    rounding added (E = ||read-back - change||) until it fits, and is zero if it never does.
    """
    sizes = {n: trained[n].numel() for n in names}
    factor, length = 1.0, float(np.linalg.norm(steps))
    for _ in range(_FIT_TRIES):
        out = _moved(trained, previous, _split(steps * factor, sizes), fraction_bits)
        codes = np.concatenate([grid_change(out[n], previous[n], fraction_bits).reshape(-1).numpy() for n in names])
        if squared_norm_within(codes, bound):
            return DpRelease(out, _split(codes, sizes))
        excess = float(np.linalg.norm(codes - steps * factor))
        factor = max(0.0, (math.sqrt(bound) - 1.01 * excess - 1.0) / length) if length > 0 else 0.0
    unchanged = {**dict(trained), **{n: previous[n].clone().to(trained[n].dtype) for n in names}}
    return DpRelease(unchanged, {n: np.zeros(sizes[n], dtype=np.int64) for n in names})


def _split(flat: np.ndarray, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
    """`flat` cut into consecutive pieces of `sizes`, in its order."""
    out, start = {}, 0
    for name, size in sizes.items():
        out[name] = flat[start : start + size]
        start += size
    return out


class CentralNoiseAverage(ServerAggregator):
    """theta^g_{t-1} + (the sum of the sites' changes on the grid + N_Z(0, sigma^2)) 2^-f / n, n the updates.

    Each update's change is read back from its tensors on the grid (`grid_change`, against
    theta^g_{t-1}, which the caller adds to `previous`) and summed exactly in int64; an update whose
    change exceeds the norm bound Delta was not clipped by its site and fails the aggregation. A
    buffered release (shared/study/buffered_dp.py) reads each change against its own base instead:
    the hooks `_base_sources`, `_base_key`, `_scaled` and `_moved_from` say where.
    """

    release = "the round"  # what its errors call the release

    def __init__(self, dp: DifferentialPrivacy, fraction_bits: int = GRID_BITS) -> None:
        super().__init__()
        self.dp, self.fraction_bits = dp, fraction_bits
        self.previous = WeightedAverage()
        self._base: dict[Hashable, dict[str, Tensor]] = {}  # base key -> name -> its run's values from its start
        self._codes: dict[str, Tensor] = {}
        self._sizes: dict[str, int] = {}
        self._squares: list[float] = []
        self._lock = threading.Lock()

    def _base_sources(self) -> dict[Hashable, WeightedAverage]:
        """Each base the updates' changes are read against, by key: here theta^g_{t-1} alone."""
        if self.previous is None or self.previous.count != 1:
            raise AggregationError("central DP noise needs theta^g_{t-1} added to `previous` once, before any update")
        return {None: self.previous}

    def _base_key(self, index: int) -> Hashable:
        """The key of the base update `index` (in the order added) trained from."""
        return None

    def _scaled(self, index: int, codes: Tensor) -> Tensor:
        """What update `index`'s change on the grid adds to the sum: all of it here."""
        return codes

    @contextmanager
    def adding(
        self, specs: Mapping[str, TensorSpec], weights: Sequence[float], order: Sequence[str] | None = None
    ) -> Iterator[Callable[[Iterable[AlignedPiece]], None]]:
        """As WeightedAverage.adding; each floating piece's change on the grid is summed beside it."""
        sources = self._base_sources()
        first = len(self._squares)
        self._squares.extend([0.0] * len(weights))
        with super().adding(specs, weights, order) as accumulate:
            if not self._codes:
                self._lay_out(specs, sources)

            def add_codes(pieces: Iterable[AlignedPiece]) -> None:
                pieces = list(pieces)
                accumulate(pieces)
                for name, start, values in pieces:
                    if name not in self._codes:
                        continue
                    stop = start + values[0].numel()  # a piece may run on into the next tensors of its run
                    total = self._codes[name][start:stop]
                    for index, update in enumerate(values, start=first):
                        base = self._base[self._base_key(index)][name][start:stop]
                        codes = grid_change(update, base, self.fraction_bits)
                        total.add_(self._scaled(index, codes))
                        square = float(codes.double().square().sum())
                        with self._lock:
                            self._squares[index] += square

            yield add_codes

    def _lay_out(self, specs: Mapping[str, TensorSpec], sources: Mapping[Hashable, WeightedAverage]) -> None:
        """Each base and the int64 sums laid out as the average's runs: each name views its run from its start."""
        bases = {key: source.result() for key, source in sources.items()}
        self._sizes = {n: specs[n].numel for n in _floating(specs)}
        self._base = {key: {} for key in bases}
        for run in tensor_runs(self._order, specs, self.run_key):
            if not specs[run[0]].dtype.is_floating_point:
                continue
            flat = {key: torch.cat([tensors[name].reshape(-1) for name in run]) for key, tensors in bases.items()}
            codes = torch.zeros(sum(specs[name].numel for name in run), dtype=torch.int64)
            offset = 0
            for name in run:
                self._codes[name] = codes[offset:]
                for key, values in flat.items():
                    self._base[key][name] = values[offset:]
                offset += specs[name].numel

    def _moved_from(self, released: Mapping[str, Tensor], noised: Mapping[str, np.ndarray]) -> dict[str, Tensor]:
        """theta^g_{t-1} + the noised sum 2^-f / n."""
        base = {name: self._base[None][name][: self._sizes[name]] for name in noised}
        return _moved(released, base, noised, self.fraction_bits, self.count)

    def result(self) -> dict[str, Tensor]:
        """theta^g_t: the noised sum of changes over the count on every floating tensor; integer ones as averaged."""
        released = super().result()
        if not self._codes:
            return released
        names = sorted(self._codes)
        dimension = sum(self._sizes.values())
        bound = norm_bound(self.dp.clip_norm, dimension, self.fraction_bits) ** 2
        for index, square in enumerate(self._squares):
            if not squares_within(square, bound):
                raise AggregationError(
                    f"update {index + 1} of {self.release} moves theta^g by {math.sqrt(square):.6g} grid steps from "
                    f"its base, beyond the bound {math.sqrt(bound):.6g} of its clipping norm"
                )
        noise = _split(
            noise_source().sample(dimension, sum_noise_variance(self.dp, dimension, self.fraction_bits)),
            {name: self._sizes[name] for name in names},
        )
        noised = {name: self._codes[name][: self._sizes[name]].numpy() + noise[name] for name in names}
        return self._moved_from(released, noised)


def add_ring_noise(narrow: np.ndarray, dp: DifferentialPrivacy, fraction_bits: int) -> None:
    """Add N_Z(0, sigma^2) to each word of a secure round's unmasked Z_{2^32} sum, in place (central DP)."""
    if narrow.dtype != np.uint32:
        raise PrivacyInputError(f"the narrow sum is uint32 words, got {narrow.dtype}")
    noise = noise_source().sample(narrow.size, sum_noise_variance(dp, narrow.size, fraction_bits))
    narrow += (noise & 0xFFFFFFFF).astype(np.uint32)  # two's complement: ring addition modulo 2^32


def honest_quorum(terms: StudyTerms, participant_count: int) -> int:
    """h: the honest sites among the fewest a round of `participant_count` releases (distributed DP's shares).

    The quorum (secure_setup.study_round_quorum) less the c sites that may collude with the
    coordinator under secure aggregation, whose noise shares it would know: the noise of the honest
    sites alone reaches z Delta on the sum. Secure rounds release at least c + 2 inputs, so this is >= 2.
    """
    from shared.study.secure_setup import colluding_sites, study_round_quorum

    secure = terms.privacy.secure_aggregation is not None
    return study_round_quorum(terms, participant_count) - (colluding_sites(terms) if secure else 0)


NOISE_TAIL = 12.0  # |N| > 12 sigma has probability below 2 exp(-72), about 1e-31, per coordinate


def ring_range_problem(terms: StudyTerms) -> str | None:
    """Why a secure DP study's sum could leave Z_{2^32}: K changes of up to Delta, plus 12 sigma of noise; or None.

    Every site sums its change on the grid with factor 1, so the sum of K of them is within K Delta
    per coordinate, and the noise of the sum (central, or up to K distributed shares of sigma^2 / h,
    h >= 1) within NOISE_TAIL sigma sqrt(K) but with negligible probability. Past the ring's range a
    coordinate would wrap: harmless to privacy (post-processing), ruinous to the model.
    """
    from shared.privacy.quantize import FixedPoint

    dp, secure = terms.privacy.dp, terms.privacy.secure_aggregation
    if dp is None or secure is None:
        return None
    bits, sites = secure.fraction_bits, len(terms.sites)
    limit = FixedPoint(bits, ring_bits=32).max_abs
    change = float(norm_bound(dp.clip_norm, dp_dimension(terms), bits)) * 2.0**-bits
    largest = sites * change + NOISE_TAIL * dp.noise_multiplier * change * math.sqrt(sites)
    if largest <= limit:
        return None
    return (
        f"the sum of {sites} clipped and noised changes may reach {largest:.4g} per value, beyond the 32-bit "
        f"ring's {limit:g} at {bits} fraction bits: lower fraction_bits or clip_norm"
    )


def dp_fraction_bits(terms: StudyTerms) -> int:
    """F of the study's DP grid: its secure aggregation's fraction_bits, else GRID_BITS."""
    secure = terms.privacy.secure_aggregation
    return secure.fraction_bits if secure is not None else GRID_BITS


def dp_dimension(terms: StudyTerms) -> int:
    """d: the floating values of the study's upload, which the clipping and the noise cover."""
    from shared.algorithms.registry import exchange_of, parsed_params

    schema = exchange_of(terms.model.config(), terms.algorithm.name, parsed_params(terms.algorithm)).upload_schema()
    return sum(schema[name].numel for name in _floating(schema))
