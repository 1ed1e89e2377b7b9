"""The epsilon a survey's noise spends: one release of discrete Gaussian counts, through the studies' accountant.

A survey releases its vector of counts once, each plus N_Z(0, sigma^2) (shared/wire/survey_release.py).
Neighbouring data sets differ by one record added or removed (`SURVEY_RELATION`; a patient with k
records is protected as a group of k), which moves the vector by at most Delta = SURVEY_L2_SENSITIVITY
= sqrt(32) in L2, so the release is (alpha, alpha Delta^2 / (2 sigma^2))-RDP at every order (Canonne,
Kamath and Steinke 2020, the multivariate discrete Gaussian). That is the RDP of one round of central
noise as shared/study/accounting.py states it, (alpha, 2 alpha / z^2), with its replace-one
sensitivity 2 Delta_clip standing for Delta: z = 2 sigma / Delta, one share, one release. The
accountant's `epsilon_after` converts it to (epsilon, delta), so a survey's epsilon and a study's
are the same computation.

The bound holds where a record's place (train, test, excluded) depends on that record alone: a
seeded hash of its id, a split file or a manifest's split column. A source split by FedCVD's own
files (`fedcvd_split`) numbers the records it keeps in reading order, so one record added moves the
places of those after it: such a source's survey is not covered by this epsilon.
"""

from __future__ import annotations

from shared.errors import PrivacyInputError
from shared.study.accounting import DpAccounting, epsilon_after
from shared.study.dp import MECHANISM
from shared.wire.survey import SURVEY_L2_SENSITIVITY, all_cells

__all__ = [
    "SURVEY_RELATION",
    "survey_accounting",
    "survey_budget_problem",
    "survey_epsilon",
    "survey_privacy_report",
    "survey_sigma",
]

SURVEY_RELATION = "add/remove-one record"


def _dimension() -> int:
    """The number of counts a survey releases (all groups, all tables): what the noise covers."""
    return len(all_cells())


def survey_accounting(noise_sigma: float, delta: float) -> DpAccounting:
    """The accountant's view of one survey release with noise N_Z(0, noise_sigma^2) on each count."""
    if not noise_sigma > 0:
        raise PrivacyInputError(f"the noise's sigma is positive, got {noise_sigma}")
    return DpAccounting(
        noise_multiplier=2 * noise_sigma / SURVEY_L2_SENSITIVITY,
        delta=delta,
        sensitivity=SURVEY_L2_SENSITIVITY,
        shares=1,
        sites=1,
        share_variance=noise_sigma**2,
        dimension=_dimension(),
    )


def survey_epsilon(noise_sigma: float, delta: float) -> float:
    """The epsilon at `delta` of one survey released with noise N_Z(0, noise_sigma^2) on each count."""
    return epsilon_after(survey_accounting(noise_sigma, delta), 1)


def survey_sigma(epsilon: float, delta: float, *, tolerance: float = 1e-4) -> float:
    """The smallest sigma (to within a relative `tolerance`, rounded up) whose one release spends at most `epsilon`."""
    if not epsilon > 0:
        raise PrivacyInputError(f"epsilon is positive, got {epsilon}")
    low, high = 1e-3, 1.0
    while survey_epsilon(high, delta) > epsilon:
        low, high = high, high * 2
        if high > 1e6:
            raise PrivacyInputError(f"no sigma up to 1e6 spends at most epsilon {epsilon} at delta {delta}")
    while high - low > tolerance * high:
        middle = (low + high) / 2
        low, high = (low, middle) if survey_epsilon(middle, delta) <= epsilon else (middle, high)
    return high


def survey_privacy_report(noise_sigma: float, delta: float) -> dict[str, object]:
    """What one noisy survey spent, in the keys of a study's privacy report (shared.wire.metrics.PrivacySpent)."""
    return {
        "epsilon": survey_epsilon(noise_sigma, delta),
        "delta": delta,
        "relation": SURVEY_RELATION,
        "sensitivity": SURVEY_L2_SENSITIVITY,
        "mechanism": MECHANISM,
        "accountant": "rdp",
        "rounds": 1,
        "noise_sigma": noise_sigma,  # an extra key: the noise's standard deviation on each count
    }


def survey_budget_problem(noise_sigma: float | None, delta: float, cap: float | None) -> str | None:
    """Why a survey may not run under an epsilon `cap`: no noise, or noise spending more; None if it may."""
    if cap is None:
        return None
    if noise_sigma is None:
        return f"this coordinator releases only noised surveys (epsilon <= {cap:g}): set survey.noise_sigma"
    spent = survey_epsilon(noise_sigma, delta)
    if spent > cap:
        return (
            f"the survey's noise (sigma {noise_sigma:g}) spends epsilon {spent:.4g} at delta {delta:g}, above this "
            f"coordinator's cap {cap:g}: sigma {survey_sigma(cap, delta):.4g} spends at most the cap"
        )
    return None
