"""Privacy accounting of DP-FedAvg over rounds with Google's dp-accounting (RDP or PLD accountant).

Each round is a Poisson-sampled Gaussian mechanism of noise multiplier z (noise over sensitivity)
with sampling rate q. Studies account with q = 1 and z / 2 (shared/privacy/study_dp.py: the
replace-one relation, and no amplification from a selection a public seed or the coordinator makes);
q < 1 is for sites that sample themselves.

RDP (Mironov 2017, with dp-accounting's improved conversion to (epsilon, delta)) is the default:
fast and an upper bound. PLD (Koskela et al. 2020; Doroshenko et al. 2022) is tighter and slower.
dp-accounting takes about 2 s to import, so it is imported on first use: sites never account.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from shared.errors import PrivacyInputError
from shared.privacy.errors import BudgetExceeded

if TYPE_CHECKING:
    from dp_accounting import PrivacyAccountant

__all__ = ["Accountant", "PrivacyBudget", "epsilon_spent", "require_budget_for_next_round", "would_exceed_budget"]

Accountant = Literal["rdp", "pld"]


@dataclass(frozen=True)
class PrivacyBudget:
    """A study's (epsilon, delta) limit for the whole of training."""

    epsilon: float
    delta: float


def epsilon_spent(
    *, noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, accountant: Accountant = "rdp"
) -> float:
    """The epsilon at `delta` after `rounds` Poisson-sampled Gaussian rounds; inf without noise."""
    if not 0 <= sampling_rate <= 1:
        raise PrivacyInputError(f"sampling_rate must lie in [0, 1], got {sampling_rate}")
    if rounds < 0 or noise_multiplier < 0:
        raise PrivacyInputError("rounds and noise_multiplier must be non-negative")
    if rounds == 0 or sampling_rate == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), rounds
    )
    tracker = _new_accountant(accountant)
    tracker.compose(event)
    return float(tracker.get_epsilon(delta))


def would_exceed_budget(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    rounds_done: int,
    budget: PrivacyBudget,
    accountant: Accountant = "rdp",
) -> bool:
    """Whether running round `rounds_done + 1` would take epsilon past the budget."""
    spent = epsilon_spent(
        noise_multiplier=noise_multiplier,
        sampling_rate=sampling_rate,
        rounds=rounds_done + 1,
        delta=budget.delta,
        accountant=accountant,
    )
    return spent > budget.epsilon


def require_budget_for_next_round(
    *,
    noise_multiplier: float,
    sampling_rate: float,
    rounds_done: int,
    budget: PrivacyBudget,
    accountant: Accountant = "rdp",
) -> None:
    """Raise BudgetExceeded if the next round would take epsilon past the budget."""
    if would_exceed_budget(
        noise_multiplier=noise_multiplier,
        sampling_rate=sampling_rate,
        rounds_done=rounds_done,
        budget=budget,
        accountant=accountant,
    ):
        raise BudgetExceeded(f"round {rounds_done + 1} would exceed epsilon {budget.epsilon} at delta {budget.delta}")


def _new_accountant(kind: Accountant) -> PrivacyAccountant:
    from dp_accounting import pld, rdp

    if kind == "rdp":
        return rdp.RdpAccountant()
    if kind == "pld":
        return pld.PLDAccountant()
    raise PrivacyInputError(f"unknown accountant {kind!r}; use 'rdp' or 'pld'")
