"""Learned heads' gate update: each head and block compared local against global on held-out records, bounded."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_names
from shared.algorithms.params import LearnedHeadsParams
from shared.model import build_model, preset
from site_agent.algorithms.learned_heads import _stepped, block_preferences, head_preferences

GATED = replace(preset("tiny"), learned_heads=True)


def loss_with_gate(
    model: torch.nn.Module, block: int, head: int, logit: float, x: torch.Tensor, y: torch.Tensor
) -> float:
    """The validation loss with one gate set to `logit`, on a copy of the model."""
    other = copy.deepcopy(model).eval()
    with torch.no_grad():
        other.get_parameter(f"blocks.{block}.head_gate")[head] = logit
        return float(torch.nn.functional.binary_cross_entropy_with_logits(other(x), y))


def gated_case(
    seed: int, block: int, spread: float
) -> tuple[torch.nn.Module, list[torch.nn.Parameter], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A gated model whose block `block` has gate logits from -spread to spread, its gates, a copy, a batch."""
    model = build_model(GATED, seed=seed)
    gates = [model.get_parameter(name) for name in gate_names(GATED)]
    with torch.no_grad():
        gates[block].copy_(torch.linspace(-spread, spread, GATED.n_heads))
    before = [gate.detach().clone() for gate in gates]
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 12, 64, generator=generator), (torch.rand(6, 20, generator=generator) > 0.7).float()
    return model, gates, before, x, y


def test_each_heads_preference_is_the_relative_fall_of_the_loss_when_local_and_gates_are_restored() -> None:
    model, gates, before, x, y = gated_case(3, block=0, spread=1.0)
    preferences = head_preferences(model, gates, x, y)
    assert preferences.shape == (GATED.n_blocks, GATED.n_heads)
    for block, head in ((0, 2), (1, 7)):
        shared = loss_with_gate(model, block, head, -FROZEN_LOGIT, x, y)
        local = loss_with_gate(model, block, head, FROZEN_LOGIT, x, y)
        assert shared != local
        assert abs(float(preferences[block, head]) - (shared - local) / shared) < 1e-9
    assert all(torch.equal(gate, kept) for gate, kept in zip(gates, before, strict=True))
    assert not model.training  # evaluated without dropout


def test_a_blocks_preference_is_the_relative_fall_of_the_loss_with_all_its_heads_local() -> None:
    model, gates, before, x, y = gated_case(4, block=1, spread=2.0)
    preferences = block_preferences(model, gates, x, y)
    assert preferences.shape == (GATED.n_blocks,)
    for block in range(GATED.n_blocks):
        losses = []
        for logit in (-FROZEN_LOGIT, FROZEN_LOGIT):
            other = copy.deepcopy(model).eval()
            with torch.no_grad():
                other.get_parameter(f"blocks.{block}.head_gate").fill_(logit)
                losses.append(float(torch.nn.functional.binary_cross_entropy_with_logits(other(x), y)))
        shared, local = losses
        assert abs(float(preferences[block]) - (shared - local) / shared) < 1e-9
    assert all(torch.equal(gate, kept) for gate, kept in zip(gates, before, strict=True))
    assert not model.training


def test_gates_step_toward_local_only_beyond_the_margin_and_stay_bounded() -> None:
    params = LearnedHeadsParams(local_margin=0.01, gate_step=1.0, gate_bound=2.0)
    logits = torch.tensor([0.0, 0.0, 1.5, -2.0, 2.0])
    preference = torch.tensor([0.02, 0.005, 0.03, -0.5, -0.02])
    stepped = _stepped(logits, preference, 0.0, params)
    assert torch.equal(stepped, torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0]))


def test_a_block_clearly_better_local_carries_its_heads_that_lower_the_loss_at_all() -> None:
    params = LearnedHeadsParams(local_margin=0.01, block_margin=0.03, gate_step=1.0, gate_bound=2.0)
    logits = torch.zeros(4)
    preference = torch.tensor([0.02, 0.005, 0.0, -0.003])
    # the block's fall beyond block_margin: a head below the margin but above 0 goes local too
    assert torch.equal(_stepped(logits, preference, 0.031, params), torch.tensor([1.0, 1.0, -1.0, -1.0]))
    # at or below block_margin only the head beyond the head's margin goes local
    assert torch.equal(_stepped(logits, preference, 0.03, params), torch.tensor([1.0, -1.0, -1.0, -1.0]))


def test_the_blocks_bar_is_its_own_not_the_heads_margin_times_h() -> None:
    """A block's fall between block_margin and H x local_margin carries its heads: the two bars are separate."""
    params = LearnedHeadsParams(local_margin=0.01, block_margin=0.02, gate_step=1.0, gate_bound=2.0)
    logits = torch.zeros(4)
    preference = torch.tensor([0.004, 0.004, 0.004, 0.004])
    assert torch.equal(_stepped(logits, preference, 0.03, params), torch.ones(4))  # 0.02 < 0.03 < 4 x 0.01
    assert torch.equal(_stepped(logits, preference, 0.015, params), -torch.ones(4))
