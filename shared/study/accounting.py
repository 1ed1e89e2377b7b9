"""The epsilon a DP study spends: the discrete Gaussian's closed-form RDP over its rounds, under replace-one.

One round of central noise N_Z(0, sigma^2), sigma = z Delta, against the replace-one sensitivity
2 Delta is (alpha, alpha (2 Delta)^2 / (2 sigma^2))-RDP = (alpha, 2 alpha / z^2)-RDP at every order
(Canonne, Kamath and Steinke, NeurIPS 2020, the multivariate discrete Gaussian's concentrated DP). A sum of
n >= h distributed shares N_Z(0, sigma^2 / h) obeys Kairouz, Liu and Steinke's closed form (ICML
2021, Proposition 14): the minimum of alpha/2 (2/z)^2 + tau d, alpha/2 ((2/z)^2 + 2 l1 tau + tau^2 d)
and alpha/2 (2/z + tau sqrt(d))^2, with l1 = sqrt(d) 2/z (the L1 sensitivity is at most sqrt(d)
times the L2) and tau = 10 sum_{k<n} exp(-2 pi^2 (sigma^2 / h) k / (k + 1)), bounded here over any
n <= K by 10 (K - 1) exp(-pi^2 sigma^2 / h); it underflows to 0 unless a share's sigma is a few
grid steps. Rounds compose over T with sampling rate 1 (no amplification is claimed: the sites a
round takes follow from a public seed, or from a coordinator that may lie), and dp-accounting's
`compute_epsilon` converts the curve to (epsilon, delta) at its default orders. dp-accounting takes
about 2 s to import, so it is imported on first use: sites never account.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.privacy.discrete import MAX_VARIANCE
from shared.study.dp import (
    MECHANISM,
    RELATION,
    dp_dimension,
    dp_fraction_bits,
    honest_quorum,
    norm_bound,
    ring_range_problem,
    sum_noise_variance,
)

if TYPE_CHECKING:
    from shared.terms import StudyTerms

__all__ = [
    "DpAccounting",
    "budget_problem",
    "dp_accounting",
    "dp_setup_problem",
    "epsilon_after",
    "privacy_report",
    "trained_rounds",
]


@dataclass(frozen=True)
class DpAccounting:
    """What the epsilon of a study's rounds depends on (`dp_accounting` builds it from the terms)."""

    noise_multiplier: float  # z: the sum's noise std over the norm bound Delta
    delta: float
    sensitivity: float  # 2 Delta in the model's units: what replacing one site's records moves the sum by
    shares: int  # noise shares of the honest sites a sum is sure to hold: 1 for central noise
    sites: int  # K: the most shares a sum may hold
    share_variance: float  # each share's variance in grid steps squared
    dimension: int  # d, the values the noise covers
    epsilon_budget: float | None = None

    @property
    def tau(self) -> float:
        """Kairouz et al.'s tau, bounded over any sum of up to K shares: 10 (K - 1) exp(-pi^2 sigma_share^2)."""
        if self.shares == 1:
            return 0.0
        return 10 * (self.sites - 1) * math.exp(-(math.pi**2) * self.share_variance)

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        """One round's RDP at each order alpha: Proposition 14 of Kairouz et al. (CKS's 2 alpha / z^2 when tau = 0)."""
        l2 = 2.0 / self.noise_multiplier  # 2 Delta / (sqrt(h) sigma_share) = 2 Delta / sigma
        l1, tau, d = math.sqrt(self.dimension) * l2, self.tau, self.dimension
        first = orders / 2 * l2**2 + tau * d
        second = orders / 2 * (l2**2 + 2 * l1 * tau + tau**2 * d)
        third = orders / 2 * (l2 + math.sqrt(d) * tau) ** 2
        return np.minimum(np.minimum(first, second), third)


def dp_accounting(terms: StudyTerms) -> DpAccounting | None:
    """The study's accounting (None without DP): noise, shares and grid as its rounds release them."""
    dp = terms.privacy.dp
    if dp is None:
        return None
    dimension, bits = dp_dimension(terms), dp_fraction_bits(terms)
    distributed = dp.mode == "distributed"
    shares = max(honest_quorum(terms, len(terms.sites)), 1) if distributed else 1
    variance = sum_noise_variance(dp, dimension, bits) / shares
    bound = norm_bound(dp.clip_norm, dimension, bits)
    return DpAccounting(
        noise_multiplier=dp.noise_multiplier,
        delta=dp.delta,
        sensitivity=float(2 * bound / 2**bits),
        shares=shares,
        sites=len(terms.sites) if distributed else 1,
        share_variance=float(variance),
        dimension=dimension,
        epsilon_budget=dp.epsilon_budget,
    )


def epsilon_after(accounting: DpAccounting, rounds: int) -> float:
    """The epsilon at the study's delta after `rounds` released models, under the replace-one relation."""
    return _epsilon(accounting, rounds)


@lru_cache(maxsize=4096)
def _epsilon(accounting: DpAccounting, rounds: int) -> float:
    if rounds <= 0:
        return 0.0
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    orders = np.asarray(rdp.DEFAULT_RDP_ORDERS, dtype=np.float64)
    epsilon, _ = rdp.compute_epsilon(orders, rounds * accounting.rdp(orders), accounting.delta)
    return float(epsilon)


def budget_problem(terms: StudyTerms, cap: float | None = None) -> str | None:
    """Why a study may not be created: its epsilon above its budget or `cap`, or no DP under a cap; None if it may."""
    accounting = dp_accounting(terms)
    if accounting is None:
        return f"this coordinator runs only studies with differential privacy (epsilon <= {cap:g})" if cap else None
    dp = terms.privacy.dp
    assert dp is not None
    if dp.accountant != "rdp":
        return (
            "the discrete Gaussian is accounted by its closed-form RDP (accountant = rdp): the PLD accountant "
            "composes the continuous Gaussian's privacy loss, which is not proven for discrete noise"
        )
    spent = epsilon_after(accounting, terms.rounds)
    for limit, what in ((dp.epsilon_budget, "privacy.dp.epsilon_budget"), (cap, "this coordinator's cap")):
        if limit is not None and spent > limit:
            affordable = _affordable(accounting, limit, terms.rounds)
            return (
                f"its {terms.rounds} rounds spend epsilon {spent:.4g} at delta {dp.delta:g} ({RELATION}, z = "
                f"{dp.noise_multiplier:g}), above {what} {limit:g}: {affordable} rounds fit, or raise noise_multiplier"
            )
    return None


def privacy_report(terms: StudyTerms, released: int) -> dict[str, Any] | None:
    """What `released` DP models have spent (None without DP): shown per round, by the study and the dashboard."""
    accounting = dp_accounting(terms)
    dp = terms.privacy.dp
    if accounting is None or dp is None:
        return None
    return {
        "epsilon": epsilon_after(accounting, released),
        "delta": dp.delta,
        "relation": RELATION,
        "sensitivity": accounting.sensitivity,
        "mechanism": MECHANISM,
        "accountant": "rdp",
        "rounds": released,
        "epsilon_budget": dp.epsilon_budget,
        "noise_multiplier": dp.noise_multiplier,
        "clip_norm": dp.clip_norm,
        "mode": dp.mode,
    }


def trained_rounds(terms: StudyTerms) -> int:
    """How many of the study's T rounds train: all of them, or as many as its epsilon budget allows."""
    accounting = dp_accounting(terms)
    if accounting is None or accounting.epsilon_budget is None:
        return terms.rounds
    return _affordable(accounting, accounting.epsilon_budget, terms.rounds)


@lru_cache(maxsize=256)
def _affordable(accounting: DpAccounting, budget: float, rounds: int) -> int:
    """The most rounds, up to `rounds`, whose epsilon stays within `budget` (epsilon grows with rounds)."""
    low, high = 0, rounds  # epsilon(low) <= budget holds: epsilon(0) = 0
    while low < high:
        middle = (low + high + 1) // 2
        if epsilon_after(accounting, middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def dp_setup_problem(terms: StudyTerms) -> tuple[tuple[str, ...], str] | None:
    """(the setting's path, why) where a DP study's noise cannot work as its terms set it up; None when it can."""
    secure = terms.privacy.secure_aggregation
    dp = terms.privacy.dp
    if dp is None:
        return None
    if dp.mode == "distributed" and secure is None:
        return ("privacy", "dp", "mode"), (
            "distributed noise needs secure_aggregation: without it the coordinator sees each site's update with "
            "only its share of the noise"
        )
    if secure is not None and secure.ring_bits != 32:
        return ("privacy", "secure_aggregation", "ring_bits"), (
            "differential privacy sums the sites' changes on the grid in Z_{2^32}: set ring_bits = 32"
        )
    problem = ring_range_problem(terms)
    if problem is not None:
        return ("privacy", "secure_aggregation", "fraction_bits"), problem
    variance = sum_noise_variance(dp, dp_dimension(terms), dp_fraction_bits(terms))
    if variance > MAX_VARIANCE:
        return ("privacy", "dp", "noise_multiplier"), (
            f"z C = {dp.noise_multiplier * dp.clip_norm:g} is {math.sqrt(variance):.3g} grid steps of noise, beyond "
            "the sampler's 2^40: lower noise_multiplier or clip_norm"
        )
    accounting = dp_accounting(terms)
    if accounting is not None and accounting.share_variance < 0.25:  # Kairouz et al.'s bound needs sigma >= 1/2
        return ("privacy", "dp", "noise_multiplier"), (
            f"each noise share's variance {accounting.share_variance:.3g} is below a quarter of a grid step squared"
        )
    if trained_rounds(terms) < 1:
        return ("privacy", "dp", "epsilon_budget"), f"epsilon_budget {dp.epsilon_budget} does not allow a single round"
    return None
