"""Planted-truth sites: labels from a teacher whose local heads are each site's own, the same spec the same data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from shared.model.network import preset
from site_agent.data.planted import PlantedSpec, planted_sites, teacher_logits

TINY = preset("tiny")


def spec(**changes: object) -> PlantedSpec:
    values: dict[str, object] = {"local_heads": (0, 8), "train_records": (12, 6), "test_records": 8, "signal_len": 64}
    return PlantedSpec.model_validate({**values, **changes})


def test_the_same_spec_gives_the_same_sites_with_each_sites_prevalence(tmp_path: Path) -> None:
    first, again = planted_sites(TINY, spec(), ["a", "b"], tmp_path), planted_sites(TINY, spec(), ["a", "b"], tmp_path)
    for one, other, n_train in zip(first, again, (12, 6), strict=True):
        assert (len(one.train), len(one.test)) == (n_train, 8)
        assert one.train.signals.shape == (n_train, 12, 64) and one.train.labels.shape == (n_train, 20)
        np.testing.assert_array_equal(one.train.labels, other.train.labels)
        np.testing.assert_array_equal(np.asarray(one.test.signals[np.arange(8)]), other.test.signals[np.arange(8)])
        labels = np.concatenate([one.train.labels, one.test.labels])
        assert set(np.unique(labels)) == {0.0, 1.0}
        share = labels.mean(axis=0)  # above the site's 75% quantile of each class's logits
        assert (share == share[0]).all() and 0.2 <= share[0] <= 0.3
    assert first[0].report.loaded == 20 and first[1].train.record_ids[0] == "b/p00008"


def test_sites_differ_only_in_their_planted_local_heads() -> None:
    x = torch.randn(6, 12, 64, generator=torch.Generator().manual_seed(1))
    alike = spec(local_heads=(0, 0))
    torch.testing.assert_close(teacher_logits(TINY, alike, 0, x), teacher_logits(TINY, alike, 1, x), rtol=0, atol=0)
    apart = spec(local_heads=(0, 8))
    assert not torch.allclose(teacher_logits(TINY, apart, 0, x), teacher_logits(TINY, apart, 1, x))
    torch.testing.assert_close(teacher_logits(TINY, apart, 0, x), teacher_logits(TINY, alike, 1, x), rtol=0, atol=0)


def test_a_spec_names_every_site_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one of each per site"):
        planted_sites(TINY, spec(train_records=(12,)), ["a", "b"], tmp_path)
    with pytest.raises(ValueError, match="H_l must be in 0..8"):
        teacher_logits(TINY, spec(local_heads=(0, 9)), 1, torch.zeros(1, 12, 64))
    with pytest.raises(ValidationError):
        spec(test_records=0)


def test_latent_sources_give_every_lead_a_mix_of_that_many_levels_and_drifts(tmp_path: Path) -> None:
    mixed = planted_sites(TINY, spec(sources=2), ["a", "b"], tmp_path)
    signals = np.concatenate([np.asarray(mixed[0].train.signals), np.asarray(mixed[1].train.signals)])
    ends = signals[:, :, -8:].mean(axis=2), signals[:, :, :8].mean(axis=2)  # (records, leads) near +1 and -1 drift
    for end in ends:  # two sources span the leads' levels and drifts, up to the white noise
        singular = np.linalg.svd(end - end.mean(axis=0), compute_uv=False)
        assert singular[2] < 0.1 * singular[1]
    apart = planted_sites(TINY, spec(), ["a", "b"], tmp_path)[0].train.signals
    singular = np.linalg.svd(np.asarray(apart)[:, :, -8:].mean(axis=2), compute_uv=False)
    assert singular[2] > 0.1 * singular[1]  # each lead its own level and drift
    again = planted_sites(TINY, spec(sources=2), ["a", "b"], tmp_path)
    np.testing.assert_array_equal(mixed[1].train.signals, again[1].train.signals)
    np.testing.assert_array_equal(mixed[1].train.labels, again[1].train.labels)
