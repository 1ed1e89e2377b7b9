"""A study's client-level DP: the update a site releases, the noise the server adds, and the epsilon spent.

DP-FedAvg (McMahan et al., ICLR 2018) over the floating-point tensors of the shared schema (model
parameters and BatchNorm statistics alike: both are learned from the site's records):

- the site releases theta^g_{t-1} + clip(theta_k - theta^g_{t-1}, C), so one site's update has L2
  norm at most C; in "distributed" mode it also adds N(0, (z C)^2 / h) itself, h the honest
  sites among the round's quorum (shared/round_terms.py `noise_quorum_of`: the quorum
  `study_secagg.round_quorum`, less the c sites that may collude with the coordinator under
  secure aggregation, whose shares it would know), so any aggregate the coordinator releases
  carries noise of standard deviation at least z C on the sum from honest sites alone;
- in "central" mode the coordinator adds N(0, (z C)^2) to the sum, that is N(0, (z C / n)^2) to the
  average of the n updates; DP studies weight sites equally (`aggregation = "equal"`), so the
  average is the sum divided by the count n, which the round's record makes public;
- the neighbouring relation is replace-one (`RELATION`): two studies are neighbours when one site's
  records are replaced by any others, which moves the sum of the clipped updates by up to 2 C
  (from u to u', |u - u'| <= 2 C) while the count n stays; so every round is a Gaussian mechanism
  of sensitivity 2 C and noise z C, accounted as noise multiplier z / 2 (`accounted_multiplier`),
  with sampling rate 1 (the sites a round takes follow from a public seed, or from a coordinator
  that may lie: no amplification by sampling is claimed).

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
    "RELATION",
    "SENSITIVITY",
    "CentralNoiseAverage",
    "accounted_multiplier",
    "add_central_noise",
    "budget_problem",
    "epsilon_after",
    "noise_source",
    "privacy_report",
    "release_update",
    "trained_rounds",
]

NOISE_SOURCE: Callable[[], NoiseSource] = SecureGaussian  # makes each round's source; a test may swap it
RELATION = "replace-one"  # neighbouring studies: one site's records replaced by any others
SENSITIVITY = 2.0  # what replacing one site's records moves the sum of clipped updates by, in units of C


def noise_source() -> NoiseSource:
    """A fresh source of N(0, 1) samples for one round's noise."""
    return NOISE_SOURCE()


def _floating(tensors: Mapping[str, Tensor]) -> list[str]:
    return [name for name, tensor in tensors.items() if tensor.is_floating_point()]


def release_update(
    trained: Mapping[str, Tensor], previous: Mapping[str, Tensor], dp: DifferentialPrivacy, quorum: int
) -> dict[str, Tensor]:
    """What a site uploads: theta^g_{t-1} plus its clipped update (plus its noise share for `quorum` honest sites)."""
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


def accounted_multiplier(noise_multiplier: float) -> float:
    """The noise multiplier the accountant composes: z C of noise against a sensitivity of 2 C, so z / 2."""
    return noise_multiplier / SENSITIVITY


def epsilon_after(dp: DifferentialPrivacy, rounds: int) -> float:
    """The epsilon at the study's delta after `rounds` released models, under the replace-one relation."""
    return epsilon_spent(
        noise_multiplier=accounted_multiplier(dp.noise_multiplier),
        sampling_rate=1.0,
        rounds=rounds,
        delta=dp.delta,
        accountant=dp.accountant,
    )


def budget_problem(dp: DifferentialPrivacy | None, rounds: int, cap: float | None = None) -> str | None:
    """Why a study of `rounds` rounds may not be created: its epsilon above its budget or `cap`; None when it may."""
    if dp is None and cap is not None:
        return f"this coordinator runs only studies with differential privacy (epsilon <= {cap:g})"
    if dp is None:
        return None
    spent = epsilon_after(dp, rounds)
    for limit, what in ((dp.epsilon_budget, "privacy.dp.epsilon_budget"), (cap, "this coordinator's cap")):
        if limit is not None and spent > limit:
            affordable = _affordable(dp.noise_multiplier, dp.delta, dp.accountant, limit, rounds)
            return (
                f"its {rounds} rounds spend epsilon {spent:.4g} at delta {dp.delta:g} ({RELATION}, z = "
                f"{dp.noise_multiplier:g}), above {what} {limit:g}: {affordable} rounds fit, or raise noise_multiplier"
            )
    return None


def privacy_report(dp: DifferentialPrivacy | None, released: int) -> dict[str, Any] | None:
    """What `released` DP models have spent (None without DP): shown per round, by the study and the dashboard."""
    if dp is None:
        return None
    return {
        "epsilon": epsilon_after(dp, released),
        "delta": dp.delta,
        "relation": RELATION,
        "sensitivity": SENSITIVITY * dp.clip_norm,
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
            noise_multiplier=accounted_multiplier(noise_multiplier),
            sampling_rate=1.0,
            rounds=middle,
            delta=delta,
            accountant=accountant,
        )
        if spent <= budget:
            low = middle
        else:
            high = middle - 1
    return low
