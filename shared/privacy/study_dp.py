"""A study's client-level DP: the update a site releases, the noise the server adds, and the epsilon spent.

DP-FedAvg (McMahan et al., ICLR 2018) over the floating-point tensors of the shared schema (model
parameters and BatchNorm statistics alike: both are learned from the site's records):

- the site releases theta^g_{t-1} + clip(theta_k - theta^g_{t-1}, C), so one site moves the sum of
  updates by at most C in L2 norm; in "distributed" mode it also adds N(0, (z C)^2 / t') itself,
  t' the round's quorum (shared.privacy.study_secagg.round_quorum: `min_sites`, and under secure
  aggregation the secure round's fewest survivors t + 1 of its secret sharing), so any
  aggregate the coordinator releases (of at least t' updates, however many sites dropped) carries
  noise of standard deviation at least z C on the sum;
- in "central" mode the coordinator adds N(0, (z C)^2) to the sum, that is N(0, (z C / n)^2) to the
  average of the n updates; DP studies weight sites equally (`aggregation = "equal"`), so the
  average is the sum divided by a count and the sensitivity stays C;
- every round is one Gaussian mechanism of noise multiplier z on the released model, accounted
  with sampling rate 1 (no amplification by the choice of sites is claimed: an upper bound).

Integer tensors (BatchNorm's step counters) are released as they are. The noise source is
cryptographically secure and independent of the study's seed (shared.privacy.dp.SecureGaussian);
`NOISE_SOURCE` is what both the coordinator and the in-process runner draw from, so a test can
inject the same seeded source into both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, Protocol

from torch import Tensor

from shared.algorithms.server import ServerAggregator
from shared.privacy.accounting import Accountant, epsilon_spent
from shared.privacy.dp import (
    NoiseSource,
    SecureGaussian,
    add_gaussian_noise,
    central_noise_std,
    clip_update,
    distributed_noise_std,
    model_delta,
)


class DifferentialPrivacy(Protocol):
    """A study's DP settings (shared.wire.protocol.DifferentialPrivacy), as this module reads them."""

    noise_multiplier: float
    clip_norm: float
    mode: str
    delta: float
    epsilon_budget: float | None
    accountant: Accountant


__all__ = [
    "NOISE_SOURCE",
    "CentralNoiseAverage",
    "add_central_noise",
    "epsilon_after",
    "noise_source",
    "privacy_report",
    "release_update",
    "trained_rounds",
]

NOISE_SOURCE: Callable[[], NoiseSource] = SecureGaussian  # makes each round's source; a test may swap it


def noise_source() -> NoiseSource:
    """A fresh source of N(0, 1) samples for one round's noise."""
    return NOISE_SOURCE()


def _floating(tensors: Mapping[str, Tensor]) -> list[str]:
    return [name for name, tensor in tensors.items() if tensor.is_floating_point()]


def release_update(
    trained: Mapping[str, Tensor], previous: Mapping[str, Tensor], dp: DifferentialPrivacy, quorum: int
) -> dict[str, Tensor]:
    """What a site uploads: theta^g_{t-1} plus its clipped update (plus its share of noise for `quorum` sites)."""
    names = _floating(trained)
    delta = model_delta({n: trained[n] for n in names}, {n: previous[n] for n in names})
    released = clip_update(delta, dp.clip_norm).update
    if dp.mode == "distributed":
        std = distributed_noise_std(dp.noise_multiplier, dp.clip_norm, quorum)
        released = add_gaussian_noise(released, std, noise_source())
    out = dict(trained)
    for name in names:
        out[name] = (previous[name].double() + released[name].double()).to(trained[name].dtype)
    return out


class CentralNoiseAverage(ServerAggregator):
    """The equally weighted average of the sites' released updates plus N(0, (z C / n)^2) per coordinate."""

    def __init__(self, dp: DifferentialPrivacy) -> None:
        super().__init__()
        self.dp = dp

    def result(self) -> dict[str, Tensor]:
        """theta^g_t: the average, noised on every floating-point tensor (the sum's noise over the count)."""
        average = super().result()
        return add_central_noise(average, self.dp, self.count) if self.count else average


def add_central_noise(average: Mapping[str, Tensor], dp: DifferentialPrivacy, count: int) -> dict[str, Tensor]:
    """The average of `count` released updates plus N(0, (z C / count)^2) on every floating-point tensor."""
    std = central_noise_std(dp.noise_multiplier, dp.clip_norm) / count
    names = _floating(average)
    noised = add_gaussian_noise({name: average[name] for name in names}, std, noise_source())
    return {name: noised.get(name, tensor) for name, tensor in average.items()}


def epsilon_after(dp: DifferentialPrivacy, rounds: int) -> float:
    """The epsilon at the study's delta after `rounds` released models."""
    return epsilon_spent(
        noise_multiplier=dp.noise_multiplier, sampling_rate=1.0, rounds=rounds, delta=dp.delta, accountant=dp.accountant
    )


def privacy_report(dp: DifferentialPrivacy | None, released: int) -> dict[str, Any] | None:
    """What `released` DP models have spent (None without DP): shown per round, by the study and the dashboard."""
    if dp is None:
        return None
    return {
        "epsilon": epsilon_after(dp, released),
        "delta": dp.delta,
        "rounds": released,
        "epsilon_budget": dp.epsilon_budget,
        "noise_multiplier": dp.noise_multiplier,
        "clip_norm": dp.clip_norm,
        "mode": dp.mode,
    }


def trained_rounds(dp: DifferentialPrivacy | None, rounds: int) -> int:
    """How many of the study's T rounds train: all of them, or as many as its epsilon budget allows."""
    if dp is None or dp.epsilon_budget is None:
        return rounds
    return _affordable(dp.noise_multiplier, dp.delta, dp.accountant, dp.epsilon_budget, rounds)


@lru_cache(maxsize=256)
def _affordable(noise_multiplier: float, delta: float, accountant: Accountant, budget: float, rounds: int) -> int:
    """The most rounds, up to `rounds`, whose epsilon stays within `budget` (epsilon grows with rounds)."""
    low, high = 0, rounds  # epsilon(low) <= budget holds: epsilon(0) = 0
    while low < high:
        middle = (low + high + 1) // 2
        spent = epsilon_spent(
            noise_multiplier=noise_multiplier, sampling_rate=1.0, rounds=middle, delta=delta, accountant=accountant
        )
        if spent <= budget:
            low = middle
        else:
            high = middle - 1
    return low
