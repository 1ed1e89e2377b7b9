import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from shared.privacy.dp import (
    AdaptiveClipping,
    SecureGaussian,
    add_gaussian_noise,
    central_noise_std,
    clip_update,
    distributed_noise_std,
    effective_noise_multiplier,
    global_l2_norm,
    model_delta,
    update_noise_multiplier,
)

KEY = b"k" * 32


@settings(max_examples=50, deadline=None)
@given(
    scale=st.floats(min_value=1e-6, max_value=1e6),
    clip_norm=st.floats(min_value=1e-3, max_value=1e3),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_clip_update_bounds_the_global_norm(scale: float, clip_norm: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    update = {"a": torch.randn(7, 3, generator=generator) * scale, "b": torch.randn(5, generator=generator) * scale}
    clipped = clip_update(update, clip_norm)
    assert global_l2_norm(clipped.update) <= clip_norm * (1 + 1e-6)
    assert clipped.norm == pytest.approx(global_l2_norm(update))
    if clipped.norm <= clip_norm:
        assert clipped.scale == 1.0 and all(torch.equal(clipped.update[k], update[k]) for k in update)
    else:
        assert global_l2_norm(clipped.update) == pytest.approx(clip_norm, rel=1e-5)  # direction kept, norm = C


def test_model_delta_subtracts_the_global_model() -> None:
    delta = model_delta({"w": torch.tensor([3.0, 1.0])}, {"w": torch.tensor([1.0, 1.0])})
    assert delta["w"].tolist() == [2.0, 0.0]
    with pytest.raises(ValueError):
        model_delta({"w": torch.zeros(1)}, {"v": torch.zeros(1)})


def test_secure_gaussian_matches_the_standard_normal() -> None:
    samples = SecureGaussian(KEY).standard_normal(200_001)
    count = samples.size
    assert samples.shape == (count,)
    assert abs(samples.mean()) < 5 / math.sqrt(count)
    # (n - 1) s^2 / sigma^2 ~ chi^2(n - 1): accept the variance unless it is a 1-in-a-million outlier.
    statistic = (count - 1) * samples.var(ddof=1)
    assert stats.chi2.ppf(5e-7, count - 1) < statistic < stats.chi2.ppf(1 - 5e-7, count - 1)
    assert stats.kstest(samples, "norm").pvalue > 1e-4


def test_secure_gaussian_is_keyed_and_continues_its_stream() -> None:
    fixed = SecureGaussian(KEY)
    first, second = fixed.standard_normal(10), fixed.standard_normal(10)
    np.testing.assert_array_equal(first, SecureGaussian(KEY).standard_normal(10))
    assert not np.array_equal(first, second)
    assert not np.array_equal(SecureGaussian().standard_normal(10), SecureGaussian().standard_normal(10))


def test_add_gaussian_noise_has_the_configured_std() -> None:
    update = {"b": torch.zeros(60_000, dtype=torch.float32), "a": torch.ones(40_000, dtype=torch.float64)}
    std = central_noise_std(noise_multiplier=1.1, clip_norm=0.5)
    noised = add_gaussian_noise(update, std, SecureGaussian(KEY))
    assert {k: v.dtype for k, v in noised.items()} == {"b": torch.float32, "a": torch.float64}
    noise = torch.cat([noised["a"] - 1, noised["b"].double()]).numpy()
    statistic = (noise.size - 1) * noise.var(ddof=1) / std**2
    assert stats.chi2.ppf(5e-7, noise.size - 1) < statistic < stats.chi2.ppf(1 - 5e-7, noise.size - 1)
    assert torch.equal(update["a"], torch.ones(40_000, dtype=torch.float64))  # the input is left alone


def test_distributed_noise_of_threshold_many_sites_reaches_the_central_std() -> None:
    central = central_noise_std(noise_multiplier=1.2, clip_norm=2.0)
    per_site = distributed_noise_std(noise_multiplier=1.2, clip_norm=2.0, min_contributors=4)
    assert 4 * per_site**2 == pytest.approx(central**2)
    source = SecureGaussian(KEY)
    summed = sum(source.standard_normal(100_000) * per_site for _ in range(4))
    assert summed.std() == pytest.approx(central, rel=0.01)


def test_adaptive_clipping_moves_the_clip_norm_toward_the_target_quantile() -> None:
    policy = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2)
    norms = np.random.default_rng(0).lognormal(mean=1.0, sigma=0.5, size=200)
    clip_norm = 0.1
    for _ in range(300):
        bit_sum = sum(policy.clip_bit(norm, clip_norm) for norm in norms)
        clip_norm = policy.next_clip_norm(clip_norm, bit_sum, expected_sites=len(norms))
    assert clip_norm == pytest.approx(np.median(norms), rel=0.05)
    assert policy.next_clip_norm(1.0, noised_bit_sum=50.0, expected_sites=100) < 1.0  # all fit: shrink
    assert policy.next_clip_norm(1.0, noised_bit_sum=-50.0, expected_sites=100) > 1.0  # all clipped: grow


def test_effective_and_update_noise_multipliers_are_inverse() -> None:
    update_z = update_noise_multiplier(target_noise_multiplier=1.0, count_noise_std=5.0)
    assert update_z > 1.0
    assert effective_noise_multiplier(update_z, 5.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        update_noise_multiplier(target_noise_multiplier=1.0, count_noise_std=0.4)
