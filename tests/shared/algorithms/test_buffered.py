"""FedBuff's server step: by hand, against FedAvg where it must equal it, against NumPy, whole and in pieces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared.algorithms.aggregation import weighted_average
from shared.algorithms.buffered import (
    BufferedAggregator,
    base_weights,
    buffer_weights,
    buffered_release,
    staleness_factor,
)
from shared.errors import AggregationError
from shared.tensors.codec import dump, read_header
from shared.tensors.windows import tensor_pieces


def test_staleness_weightings_by_hand() -> None:
    assert staleness_factor("inverse_sqrt", 0) == 1.0 and staleness_factor("inverse_sqrt", 3) == 0.5
    assert staleness_factor("inverse", 3) == 0.25 and staleness_factor("constant", 40) == 1.0
    with pytest.raises(AggregationError, match="lag behind by -1"):
        staleness_factor("inverse_sqrt", -1)
    with pytest.raises(AggregationError, match="unknown staleness weighting 'linear'"):
        staleness_factor("linear", 1)  # type: ignore[arg-type]
    assert buffer_weights([0.5, 0.5], [0, 3], "inverse_sqrt") == [0.5, 0.25]  # not renormalised
    assert base_weights([4, 2, 4], [0.25, 0.5, 0.125]) == {2: 0.5, 4: 0.375}


def test_a_release_by_hand() -> None:
    versions = {
        0: {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(1)},
        1: {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)},
    }
    fresh = ({"w": torch.tensor([3.0, 2.0]), "n": torch.tensor(7)}, 0.5, 1)  # from theta^g_1, the current version
    stale = ({"w": torch.tensor([2.0, 2.0]), "n": torch.tensor(4)}, 0.5 / math.sqrt(2), 0)  # one version behind
    released = buffered_release(BufferedAggregator(server_lr=1.0), versions[1], versions, [fresh, stale])
    # theta_1 + 0.5 (θ_a - theta_1) + 0.5/sqrt(2) (θ_b - theta_0) = (1 + 1 + 1/sqrt 2, 2 + 0 + 1/sqrt 2)
    half = 1 / math.sqrt(2)
    torch.testing.assert_close(released["w"], torch.tensor([2.0 + half, 2.0 + half]))
    assert int(released["n"]) == 7  # integer buffers: the maximum, as in every average
    halved = buffered_release(BufferedAggregator(server_lr=0.5), versions[1], versions, [fresh, stale])
    torch.testing.assert_close(halved["w"], torch.tensor([1.5 + half / 2, 2.0 + half / 2]))


def test_fresh_updates_at_rate_one_release_fedavgs_model_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(1)
    current = {"w": torch.randn(1000, generator=generator), "b": torch.randn(7, 3, generator=generator)}
    updates = [({name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in current.items()}, w)
               for w in (0.25, 0.125, 0.625)]  # fmt: skip
    released = buffered_release(BufferedAggregator(1.0), current, {5: current}, [(t, w, 5) for t, w in updates])
    average = weighted_average(updates)
    assert all(torch.equal(released[name], average[name]) for name in current)


def test_a_release_agrees_with_numpy_in_float64() -> None:
    generator = torch.Generator().manual_seed(2)
    versions = {v: {"w": torch.randn(500, generator=generator)} for v in (3, 4, 5)}
    bases, lags = [5, 3, 4, 3], [0, 2, 1, 2]
    trained = [{"w": versions[b]["w"] + 0.05 * torch.randn(500, generator=generator)} for b in bases]
    weights = buffer_weights([0.1, 0.2, 0.3, 0.4], lags, "inverse_sqrt")
    updates = [(t, w, b) for t, w, b in zip(trained, weights, bases, strict=True)]
    released = buffered_release(BufferedAggregator(0.8), versions[5], versions, updates)
    expected = versions[5]["w"].double().numpy() + 0.8 * sum(
        w * (t["w"].double().numpy() - versions[b]["w"].double().numpy()) for t, w, b in updates
    )
    np.testing.assert_allclose(released["w"].numpy(), expected, rtol=0, atol=4e-7)


def test_stored_pieces_give_the_bits_of_memory() -> None:
    generator = torch.Generator().manual_seed(3)
    versions = {v: {"w": torch.randn(300, generator=generator), "n": torch.tensor(v)} for v in (1, 2)}
    updates = [({"w": torch.randn(300, generator=generator), "n": torch.tensor(9)}, w, b)
               for w, b in ((0.4, 2), (0.3, 1), (0.2, 2))]  # fmt: skip
    in_memory = buffered_release(BufferedAggregator(0.7), versions[2], versions, updates)
    stored = BufferedAggregator(0.7)
    assert stored.previous is not None
    stored.previous.add(versions[2], 1.0)
    for base, weight in base_weights([b for *_, b in updates], [w for _, w, _ in updates]).items():
        stored.bases.add(versions[base], weight)
    for tensors, weight, _ in updates:
        blob = dump(tensors)
        header = read_header(blob)

        def read(offset: int, size: int, blob: bytes = blob) -> bytes:
            return blob[offset : offset + size]

        stored.add_pieces(header.specs, tensor_pieces(header, read, max_bytes=64), weight)
    released = stored.result()
    assert all(torch.equal(released[name], in_memory[name]) for name in in_memory)


def test_refusals_name_what_is_missing() -> None:
    current = {"w": torch.ones(2)}
    with pytest.raises(AggregationError, match="versions \\[0\\]"):
        buffered_release(BufferedAggregator(1.0), current, {1: current}, [(current, 1.0, 0)])
    lopsided = BufferedAggregator(1.0)
    assert lopsided.previous is not None
    lopsided.previous.add(current, 1.0)
    lopsided.bases.add(current, 0.5)
    lopsided.add(current, 1.0)
    with pytest.raises(AggregationError, match="bases' weights sum to 0.5"):
        lopsided.result()
    alone = BufferedAggregator(1.0)
    alone.add(current, 1.0)
    with pytest.raises(AggregationError, match="theta\\^g_v"):
        alone.result()
    with pytest.raises(AggregationError, match="learning rate"):
        BufferedAggregator(0.0)
