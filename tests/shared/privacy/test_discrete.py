"""The exact discrete Gaussian sampler, conditional rounding, and the closed-form RDP against direct sums."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from shared.errors import PrivacyInputError
from shared.privacy import discrete
from shared.privacy.discrete import DiscreteGaussian, conditional_round, squared_norm_within
from shared.study.accounting import DpAccounting

KEY = b"\x2a" * 32


def pmf(variance: float, support: np.ndarray) -> np.ndarray:
    """N_Z(0, variance) on `support`, normalised over a support wide enough to hold all its mass."""
    wide = np.arange(-int(60 * math.sqrt(variance)) - 60, int(60 * math.sqrt(variance)) + 61)
    total = np.exp(-(wide.astype(np.float64) ** 2) / (2 * variance)).sum()
    return np.exp(-(support.astype(np.float64) ** 2) / (2 * variance)) / total


def chi_square_p(samples: np.ndarray, variance: float) -> float:
    """The chi-square test's p-value of the samples against N_Z(0, variance), tails pooled."""
    reach = max(3, int(4 * math.sqrt(variance)))
    support = np.arange(-reach, reach + 1)
    expected = pmf(variance, support) * samples.size
    observed = np.array([(samples == k).sum() for k in support], dtype=np.float64)
    tail_expected, tail_observed = samples.size - expected.sum(), samples.size - observed.sum()
    chi2 = (((observed - expected) ** 2) / expected).sum() + (tail_observed - tail_expected) ** 2 / tail_expected
    return float(stats.chi2.sf(chi2, df=support.size))


@pytest.mark.parametrize("variance", [Fraction(3, 10), Fraction(2), Fraction(15, 2), Fraction(40)])
def test_small_variances_follow_the_discrete_gaussian_exactly(variance: Fraction) -> None:
    samples = DiscreteGaussian(KEY).sample(400_000, variance)
    assert samples.dtype == np.int64
    assert chi_square_p(samples, float(variance)) > 1e-4


def test_the_exact_path_alone_gives_the_same_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a margin of one half nearly every decision goes to the decimal path: the law must not move."""
    monkeypatch.setattr(discrete, "_REL", 0.5)
    samples = DiscreteGaussian(KEY).sample(20_000, Fraction(5, 2))
    assert chi_square_p(samples, 2.5) > 1e-4


@pytest.mark.parametrize("variance", [Fraction(10**6), Fraction(int((0.1 * 2**24) ** 2))])
def test_large_variances_have_their_variance_on_the_integers(variance: Fraction) -> None:
    samples = DiscreteGaussian(KEY).sample(300_000, variance)
    sigma = math.sqrt(float(variance))
    assert samples.var() / float(variance) == pytest.approx(1.0, abs=0.01)
    assert abs(samples.mean()) < 5 * sigma / math.sqrt(samples.size)
    for modulus in (2, 3, 16):  # every residue equally often: the support is all the integers, no coarser grid
        counts = np.bincount(samples % modulus, minlength=modulus)
        assert stats.chisquare(counts).pvalue > 1e-4
    assert stats.kurtosis(samples) == pytest.approx(0.0, abs=0.05)  # Gaussian tails, not truncated ones


def test_a_key_repeats_its_samples_and_the_os_never_does() -> None:
    first = DiscreteGaussian(KEY).sample(1000, Fraction(50))
    np.testing.assert_array_equal(first, DiscreteGaussian(KEY).sample(1000, Fraction(50)))
    assert not np.array_equal(
        DiscreteGaussian().sample(1000, Fraction(50)), DiscreteGaussian().sample(1000, Fraction(50))
    )
    assert not DiscreteGaussian(KEY).sample(10, Fraction(0)).any()
    with pytest.raises(PrivacyInputError):
        DiscreteGaussian(KEY).sample(10, Fraction(-1))


def test_conditional_rounding_is_unbiased_and_within_its_bound() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(size=5000) * 3
    bound = (Fraction(float(np.linalg.norm(values))) + Fraction(math.isqrt(5000) + 1, 2)) ** 2
    source = DiscreteGaussian(KEY)
    draws = np.stack([conditional_round(values, bound, source) for _ in range(200)])
    assert np.all(np.abs(draws - values) < 1)
    assert all(squared_norm_within(d, bound) for d in draws)
    assert np.abs(draws.mean(axis=0) - values).mean() < 0.05  # unbiased: E[round(x)] = x
    above = np.arange(1, 5001) + 0.3  # any rounding up lengthens the vector: only the nearest integers fit
    tight = Fraction(int(np.square(np.rint(above)).sum()))
    np.testing.assert_array_equal(conditional_round(above, tight, source), np.rint(above))
    with pytest.raises(PrivacyInputError, match="exceeds the rounding bound"):
        conditional_round(above, tight - 1, source)


def test_the_norm_check_is_certified_at_the_boundary() -> None:
    vector = np.array([3, 4], dtype=np.int64)
    assert squared_norm_within(vector, Fraction(25)) and not squared_norm_within(
        vector, Fraction(24_999_999, 1_000_000)
    )
    huge = np.full(4, 2**30, dtype=np.int64)  # 2^62: past exact float64 sums, the margin decides
    assert squared_norm_within(huge, Fraction(2**62) * (1 + Fraction(1, 2**39)))
    assert not squared_norm_within(huge, Fraction(2**62))


# -- the accounting's closed form against a direct computation -------------------------------------------------


def renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    """D_alpha(P || Q) of two distributions on the same support, in nats, summed in log space."""
    mask = p > 0
    logs = order * np.log(p[mask]) + (1 - order) * np.log(q[mask])
    top = logs.max()
    return float((top + math.log(np.exp(logs - top).sum())) / (order - 1))


def sum_of_shares(shares: int, variance: float, reach: int) -> np.ndarray:
    """The law of the sum of `shares` independent N_Z(0, variance) on [-reach, reach] (by convolution)."""
    one = pmf(variance, np.arange(-reach, reach + 1))
    law = one
    for _ in range(shares - 1):
        law = np.convolve(law, one)
    middle = law.size // 2
    return law[middle - reach : middle + reach + 1]


@pytest.mark.parametrize(
    ("shares", "variance", "shift"), [(1, 0.6, 1), (1, 4.0, 3), (2, 0.3, 1), (3, 0.5, 2), (4, 1.5, 2)]
)
def test_the_rdp_bound_holds_against_the_direct_divergence(shares: int, variance: float, shift: int) -> None:
    """One coordinate: D_alpha between the sum of n discrete Gaussian shares and its shift by Delta.

    The bound is Proposition 14 of Kairouz et al. (ICML 2021) with their exact tau; for one share it
    is the Gaussian's alpha Delta^2 / (2 sigma^2) (Canonne et al.), which the discrete one never exceeds.
    """
    reach = int(25 * math.sqrt(shares * variance)) + 10  # far enough: the mass beyond is below 1e-130
    law = sum_of_shares(shares, variance, reach)
    shifted = np.concatenate([np.full(shift, law[0]), law[:-shift]])  # P moved by Delta (the far tail: negligible)
    tau = 10 * sum(math.exp(-2 * math.pi**2 * variance * k / (k + 1)) for k in range(1, shares))
    accounting = DpAccounting(
        noise_multiplier=2 * math.sqrt(shares * variance) / shift,  # so that 2 / z = Delta / (sqrt(n) sigma)
        delta=1e-5,
        sensitivity=1.0,
        shares=shares,
        sites=shares,
        share_variance=variance,
        dimension=1,
    )
    for order in (1.5, 2.0, 4.0, 8.0):
        direct = renyi(shifted, law, order)
        exact_tau_bound = _prop14(order, shift / math.sqrt(shares * variance), tau)
        ours = float(accounting.rdp(np.array([order]))[0])
        assert direct <= exact_tau_bound * (1 + 1e-9) + 1e-12, (order, direct, exact_tau_bound)
        assert exact_tau_bound <= ours * (1 + 1e-12)  # our tau bounds theirs from above
        if shares == 1:
            assert ours == pytest.approx(order * shift**2 / (2 * variance), rel=1e-12)
            if variance > 1:
                assert direct == pytest.approx(ours, rel=0.05)


def _prop14(order: float, l2: float, tau: float) -> float:
    """Kairouz et al.'s Proposition 14 for d = 1 (then the L1 sensitivity is the L2 one)."""
    first = order / 2 * l2**2 + tau
    second = order / 2 * (l2**2 + 2 * l2 * tau + tau**2)
    third = order / 2 * (l2 + tau) ** 2
    return min(first, second, third)


def test_large_shares_reduce_to_the_gaussian_curve() -> None:
    accounting = DpAccounting(1.0, 1e-5, 0.2, shares=3, sites=8, share_variance=1e9, dimension=10**7)
    orders = np.array([1.5, 4.0, 32.0])
    assert accounting.tau == 0.0
    np.testing.assert_allclose(accounting.rdp(orders), 2 * orders / 1.0**2, rtol=1e-15)
