"""Learned heads: gates in [0, 1], the entropy penalty, hard freezing, aggregation by uploaded usages, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from shared.algorithms.head_splits import HeadSplitAverage
from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_entropy, hardened
from shared.algorithms.server import next_global
from shared.model.network import build_model, preset
from shared.model.partition import model_partition
from shared.wire.protocol import UpdateMeta
from site_agent.algorithms.learned_heads import gate_penalty


def test_gates_are_in_unit_interval_and_in_phi_k() -> None:
    gated = replace(preset("tiny", "6:2"), learned_heads=True)
    model = build_model(gated, seed=1)
    gates = [torch.sigmoid(b.head_gate) for b in model.blocks]
    assert all(bool(((g >= 0) & (g <= 1)).all()) for g in gates)
    partition = model_partition(gated)
    assert {f"blocks.{b}.head_gate" for b in range(gated.n_blocks)} <= set(partition.local)
    assert model(torch.randn(2, gated.n_leads, gated.signal_len)).shape == (2, gated.n_classes)


def test_penalty_pushes_gates_toward_zero_or_one() -> None:
    logits = torch.nn.Parameter(torch.tensor([0.3, -0.2, 1.0, -2.0]))
    optimizer = torch.optim.SGD([logits], lr=1.0)
    term = gate_penalty([logits], 1.0)
    before = gate_entropy(logits).detach().clone()
    for _ in range(200):
        optimizer.zero_grad()
        term().backward()
        optimizer.step()
    gates = torch.sigmoid(logits)
    assert bool((gate_entropy(logits) < before).all())
    assert bool(((gates < 0.05) | (gates > 0.95)).all())
    assert torch.equal(gates > 0.5, torch.tensor([True, False, True, False]))  # each toward its nearer end


def test_hardened_gates_are_exactly_zero_or_one_with_zero_gradient() -> None:
    logits = torch.nn.Parameter(hardened(torch.tensor([0.1, -0.1, 0.0])))
    assert torch.equal(logits.detach(), torch.tensor([FROZEN_LOGIT, -FROZEN_LOGIT, FROZEN_LOGIT]))
    gates = torch.sigmoid(logits)
    assert torch.equal(gates.detach(), torch.tensor([1.0, 0.0, 1.0]))
    (gates.sum() + gate_entropy(logits).sum()).backward()
    assert logits.grad is not None and torch.equal(logits.grad, torch.zeros(3))


def test_an_undecided_gate_hardens_to_the_side_asked_for_and_no_other_gate_does() -> None:
    logits = torch.tensor([0.1, -0.1, 0.0])
    assert torch.equal(hardened(logits, "global"), torch.tensor([FROZEN_LOGIT, -FROZEN_LOGIT, -FROZEN_LOGIT]))
    assert torch.equal(hardened(logits, "local"), torch.tensor([FROZEN_LOGIT, -FROZEN_LOGIT, FROZEN_LOGIT]))


def test_average_with_uploaded_usages_matches_an_oracle() -> None:
    config = preset("tiny", "6:2")
    H, E, D = config.n_heads, config.head_dim, config.d_model
    name, bias = "blocks.0.global_branch.out_proj.weight", "blocks.0.global_branch.out_proj.bias"
    other = "head.bias"
    torch.manual_seed(0)
    updates = [{name: torch.randn(D, H * E), bias: torch.randn(D), other: torch.randn(3)} for _ in range(2)]
    previous = {name: torch.randn(D, H * E), bias: torch.randn(D), other: torch.randn(3)}
    usages = [torch.rand(config.n_blocks, H, dtype=torch.float64) for _ in range(2)]
    usages[0][0, 2] = usages[1][0, 2] = 0.0  # head 2 of block 0 used by no site: keeps theta^g_{t-1}
    weights = [0.25, 0.75]
    theta = next_global(
        HeadSplitAverage(config, usages, bias="mean"), previous, list(zip(updates, weights, strict=True))
    )
    for h in range(H):
        cols = slice(h * E, (h + 1) * E)
        factors = [w * float(u[0, h]) for w, u in zip(weights, usages, strict=True)]
        if sum(factors) == 0:
            expected = previous[name][:, cols]
        else:
            expected = sum(f * u[name][:, cols].double() for f, u in zip(factors, updates, strict=True)) / sum(factors)
        torch.testing.assert_close(theta[name][:, cols], expected.float(), rtol=1e-6, atol=1e-6)
    bias_factors = [w * float(u[0].mean()) for w, u in zip(weights, usages, strict=True)]
    expected_bias = sum(f * u[bias].double() for f, u in zip(bias_factors, updates, strict=True)) / sum(bias_factors)
    torch.testing.assert_close(theta[bias], expected_bias.float(), rtol=1e-6, atol=1e-6)
    expected_other = sum(w * u[other].double() for w, u in zip(weights, updates, strict=True))
    torch.testing.assert_close(theta[other], expected_other.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("usage", [[[1.5, 0.0]], [[-0.1, 0.0]], [[float("nan"), 0.0]]])
def test_update_meta_refuses_usages_outside_unit_interval(usage: list[list[float]]) -> None:
    with pytest.raises(ValidationError):
        UpdateMeta(num_examples=3, metrics={"loss": 0.5}, train_seconds=1.0, head_usage=usage)  # type: ignore[arg-type]
