"""Central DP for a buffered release: each change against its own base on the grid, scaled by s(τ), summed, noised."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared.algorithms.aggregation import WeightedAverage
from shared.algorithms.server import ServerAggregator
from shared.errors import AggregationError
from shared.study import dp as study_dp
from shared.study.buffered_dp import BufferedCentralNoise
from shared.study.checks import checked_terms
from shared.study.server_round import SiteReport, buffered_server_round
from shared.terms import StudyTerms

BITS = study_dp.GRID_BITS
CLIP = 0.5


class KnownNoise:
    """Noise of known integers: -1, 0, 1, -1, ... grid steps."""

    def sample(self, size: int, variance: object) -> np.ndarray:
        return np.arange(size, dtype=np.int64) % 3 - 1


def terms(server_lr: float = 0.8) -> StudyTerms:
    return checked_terms(
        StudyTerms.model_validate(
            {
                "sites": ["a", "b", "c"],
                "model": {"preset": "tiny"},
                "aggregation": {"name": "equal"},
                "buffered": {"buffer_size": 2, "server_lr": server_lr},
                "privacy": {"dp": {"noise_multiplier": 1.0, "clip_norm": CLIP, "mode": "central"}},
            }
        )
    )


def release(study: StudyTerms, versions: dict, updates: list[tuple[str, dict, int]], current: int) -> tuple:
    reports = [SiteReport(site, 10, {}) for site, _, _ in updates]

    def add_previous(average: WeightedAverage) -> None:
        average.add(versions[current], 1.0)

    def add_base(average: WeightedAverage, base: int, weight: float) -> None:
        average.add(versions[base], weight)

    def add_updates(aggregator: ServerAggregator, weights: list[float]) -> None:
        for (_, tensors, _), weight in zip(updates, weights, strict=True):
            aggregator.add(tensors, weight)

    bases = [base for _, _, base in updates]
    return buffered_server_round(study, reports, bases, current, add_previous, add_base, add_updates)


def models(seed: int = 0) -> tuple[dict, list[tuple[str, dict, int]]]:
    generator = torch.Generator().manual_seed(seed)

    def model() -> dict[str, torch.Tensor]:
        return {"w": torch.randn(40, generator=generator), "b": torch.randn(6, generator=generator),
                "steps": torch.tensor([3])}  # fmt: skip

    versions = {v: model() for v in (0, 1, 2)}

    def moved(base: int, scale: float, steps: int) -> dict[str, torch.Tensor]:
        change = {n: torch.randn(t.shape, generator=generator) for n, t in versions[base].items() if n != "steps"}
        norm = math.sqrt(sum(float(c.square().sum()) for c in change.values()))
        out = {n: versions[base][n] + c * (scale * CLIP / norm) for n, c in change.items()}
        return {**out, "steps": torch.tensor([steps])}

    return versions, [("a", moved(2, 0.9, 5), 2), ("c", moved(0, 0.7, 4), 0)]  # c trained from version 0


def test_each_change_against_its_own_base_scaled_summed_noised_over_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda _key: KnownNoise())
    versions, updates = models()
    theta, weights = release(terms(), versions, updates, current=2)
    factors = [1.0, 1.0 / math.sqrt(3)]  # s(0), s(2)
    assert weights == pytest.approx([0.5 * f for f in factors])
    names = sorted(n for n in versions[2] if n != "steps")  # the noise runs over the floating tensors by name
    for name in names:
        total = np.zeros(versions[2][name].numel(), dtype=np.int64)
        for (_, tensors, base), factor in zip(updates, factors, strict=True):
            codes = np.rint((tensors[name].double().numpy() - versions[base][name].double().numpy()) * 2.0**BITS)
            total += np.trunc(codes * factor).astype(np.int64)  # toward zero: no coordinate grows
        steps = total + _noise(names, name, versions)
        expected = versions[2][name].double().numpy() + 0.8 * steps * 2.0**-BITS / 2  # eta, over the count n = 2
        np.testing.assert_allclose(theta[name].double().numpy(), expected.astype(np.float32), rtol=0, atol=1e-6)
    assert theta["steps"].item() == 5  # integer tensors: the updates' maximum


def _noise(names: list[str], name: str, versions: dict) -> np.ndarray:
    """The known noise's slice for `name`: one draw over the floating tensors in name order."""
    sizes = [versions[2][n].numel() for n in names]
    noise = np.arange(sum(sizes), dtype=np.int64) % 3 - 1
    start = sum(sizes[: names.index(name)])
    return noise[start : start + versions[2][name].numel()]


def test_an_update_beyond_its_clip_from_its_own_base_fails_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda _key: KnownNoise())
    versions, updates = models(1)
    site, tensors, _ = updates[1]
    updates[1] = (site, tensors, 2)  # within the clip of version 0, far beyond it of version 2
    with pytest.raises(AggregationError, match=r"update 2 of the buffer moves theta\^g by .* from its base, beyond"):
        release(terms(), versions, updates, current=2)


def test_the_noise_is_drawn_once_a_release_at_the_terms_scale() -> None:
    draws: list[tuple[int, object]] = []

    class Recording(KnownNoise):
        def sample(self, size: int, variance: object) -> np.ndarray:
            draws.append((size, variance))
            return super().sample(size, variance)

    study = terms()
    versions, updates = models(2)
    original = study_dp.NOISE_SOURCE
    study_dp.NOISE_SOURCE = lambda _key: Recording()  # type: ignore[assignment]
    try:
        release(study, versions, updates, current=2)
    finally:
        study_dp.NOISE_SOURCE = original
    dimension = 46
    assert draws == [(dimension, study_dp.sum_noise_variance(study.privacy.dp, dimension, BITS))]


def test_on_a_coarse_grid_stale_changes_shrink_toward_zero_and_the_noise_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fraction bits (steps of 1/4), so truncation and each noise step show in float32."""
    monkeypatch.setattr(study_dp, "NOISE_SOURCE", lambda _key: KnownNoise())  # -1, 0, 1
    dp = terms().privacy.dp
    assert dp is not None and dp.clip_norm == CLIP
    versions = {0: {"w": torch.zeros(3)}, 2: {"w": torch.ones(3)}}
    fresh = {"w": torch.tensor([1.75, 1.0, 0.5])}  # from version 2: 3, 0, -2 steps
    stale = {"w": torch.tensor([0.25, -0.25, 0.25])}  # from version 0: 1, -1, 1 steps, weighed by 1/sqrt(3)
    noised = BufferedCentralNoise(
        dp.model_copy(update={"clip_norm": 1.0}), 0.8, [2, 0], [1.0, 1 / math.sqrt(3)], fraction_bits=2
    )
    assert noised.previous is not None
    noised.previous.add(versions[2], 1.0)
    for base in (0, 2):
        noised.version(base).add(versions[base], 1.0)
    noised.add(fresh, 0.5)
    noised.add(stale, 0.5)
    # trunc(0.577 * (1, -1, 1)) = (0, 0, 0): rounding would give (1, -1, 1); the sum 3, 0, -2 plus noise -1, 0, 1
    # is 2, 0, -1 steps; theta = 1 + 0.8 * steps / 4 / 2
    assert noised.result()["w"].tolist() == pytest.approx([1.2, 1.0, 0.9], abs=1e-7)
