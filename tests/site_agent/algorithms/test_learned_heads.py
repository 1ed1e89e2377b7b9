"""Learned heads' gate update: each head and block compared local against global on held-out records, bounded."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_names
from shared.algorithms.params import LearnedHeadsParams
from shared.model import build_model, preset
from site_agent.algorithms.learned_heads import _stepped, _train_shared_all_global, block_preferences, head_preferences
from site_agent.algorithms.uncertainty import validation_seed
from site_agent.data.loader import SiteData, SplitArrays, carve_validation
from tests.site_agent.algorithms.conftest import assert_same, context, differs, local_round, study

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


def test_the_step_test_compares_each_logit_one_shift_down_against_one_up_where_it_stands() -> None:
    model, gates, before, x, y = gated_case(5, block=0, spread=1.5)
    preferences = head_preferences(model, gates, x, y, shift=0.5)
    for block, head in ((0, 0), (0, 5), (1, 3)):
        stands = float(before[block][head])
        lower = loss_with_gate(model, block, head, stands - 0.5, x, y)
        higher = loss_with_gate(model, block, head, stands + 0.5, x, y)
        assert lower != higher
        assert abs(float(preferences[block, head]) - (lower - higher) / lower) < 1e-9
    assert not torch.equal(preferences, head_preferences(model, gates, x, y))  # not the extremes' answer
    blocks = block_preferences(model, gates, x, y, shift=0.5)
    other = copy.deepcopy(model).eval()
    losses = []
    with torch.no_grad():
        for sign in (-1.0, 1.0):
            other.get_parameter("blocks.0.head_gate").copy_(before[0] + sign * 0.5)
            losses.append(float(torch.nn.functional.binary_cross_entropy_with_logits(other(x), y)))
    assert abs(float(blocks[0]) - (losses[0] - losses[1]) / losses[0]) < 1e-9
    assert all(torch.equal(gate, kept) for gate, kept in zip(gates, before, strict=True))


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


def carve_of(data: SiteData, fraction: float) -> np.ndarray:
    """The rows of `data`'s training split that learned heads holds out at this study's seed."""
    _, validation = carve_validation(data.train, seed=validation_seed(5, "learned_heads"), fraction=fraction)
    return np.array([data.train.record_ids.index(record) for record in validation.record_ids])


def with_carve_labels_flipped(data: SiteData, rows: np.ndarray) -> SiteData:
    """`data` whose carve records have every label flipped; the other records unchanged."""
    labels = np.array(data.train.labels, copy=True)
    labels[rows] = 1 - labels[rows]
    return replace(data, train=SplitArrays(data.train.signals, labels, data.train.record_ids))


@pytest.mark.parametrize("carve_trains_shared", [False, True])
def test_the_carve_trains_theta_g_only_when_asked_and_never_the_local_heads(
    site: SiteData, carve_trains_shared: bool
) -> None:
    """First round (no gate step): the carve's labels reach the upload only with carve_trains_shared."""
    params = {"validation_fraction": 0.4, "carve_trains_shared": carve_trains_shared}
    config = study("learned_heads", params, training={"lr": 0.05, "batch_size": 8})
    flipped = with_carve_labels_flipped(site, carve_of(site, 0.4))
    first, second = (local_round(config, data, round_=1) for data in (site, flipped))
    assert differs(first.shared, second.shared) == carve_trains_shared


def test_training_on_the_carve_moves_theta_g_with_every_head_global_and_restores_the_gates(site: SiteData) -> None:
    config = study("learned_heads", {"carve_trains_shared": True}, training={"lr": 0.05, "batch_size": 8})
    ctx = context(config, site)
    model = ctx.build(ctx.start_state())
    gates = [model.get_parameter(name) for name in gate_names(ctx.config)]
    with torch.no_grad():
        gates[0].copy_(torch.linspace(-2.0, 2.0, ctx.config.n_heads))  # some heads mostly local
    before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    carve = replace(ctx, data=replace(ctx.data, train=site.train.subset(np.arange(8))))
    result = _train_shared_all_global(carve, model, gates)
    after = model.state_dict()
    local = ctx.exchange.partition.local
    assert result.steps > 0 and result.samples > 0
    assert_same({name: after[name] for name in local}, {name: before[name] for name in local})  # gates too
    shared = ctx.exchange.shared_parameters(ctx.config)
    assert all(not after[name].equal(before[name]) for name in shared if ".global_branch." in name)
