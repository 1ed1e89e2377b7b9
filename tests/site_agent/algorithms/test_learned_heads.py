"""Learned heads' gate update: each head and block compared local against global on held-out records, bounded."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from shared.algorithms.exchange import (
    LEARNED_HEADS_BLOCK_FALLS,
    LEARNED_HEADS_HEAD_FALLS,
    LEARNED_HEADS_ROUNDS,
    LEARNED_HEADS_SETTLED,
)
from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_names
from shared.algorithms.params import LearnedHeadsParams
from shared.model.network import LOCAL_BRANCH_PATTERN, build_model, preset
from site_agent.algorithms import learned_heads
from site_agent.algorithms.base import RoundContext
from site_agent.algorithms.learned_heads import (
    _counts,
    _evidence,
    _stepped,
    block_preferences,
    carve_batches,
    cross_fitted_preferences,
    head_preferences,
    local_probe,
)
from site_agent.data.loader import SiteData, carve_validation
from tests.site_agent.algorithms.conftest import context, study

GATED = replace(preset("tiny"), learned_heads=True)
# The held-out-carve method, the defaults before the cross-fitted one: the tests below name it in full.
CARVE_METHOD: dict[str, Any] = {
    "gate_test": "extremes",
    "local_margin": 0.005,
    "block_margin": 0.024,
    "gate_bound": 2.0,
    "settle_after": None,
    "probe_folds": 0,
    "probe_epochs": 0,
    "evidence": "round",
    "undecided": "local",
}


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
    params = LearnedHeadsParams(local_margin=0.01, block_margin=0.024, gate_step=1.0, gate_bound=2.0)
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


@pytest.mark.parametrize(("gate_test", "shift"), [("extremes", None), ("step", 0.5)])
def test_a_rounds_comparison_uses_the_studys_gate_test(
    site: SiteData, monkeypatch: pytest.MonkeyPatch, gate_test: str, shift: float | None
) -> None:
    """From the second round on, both comparisons get gate_step as their shift with "step", none with "extremes"."""
    seen: list[float | None] = []

    def recording(compare: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: Any) -> torch.Tensor:  # model, gates, x, y, shift
            seen.append(args[4] if len(args) > 4 else None)
            return compare(*args)

        return wrapped

    monkeypatch.setattr(learned_heads, "head_preferences", recording(learned_heads.head_preferences))
    monkeypatch.setattr(learned_heads, "block_preferences", recording(learned_heads.block_preferences))
    config = study("learned_heads", {**CARVE_METHOD, "gate_test": gate_test, "gate_step": 0.5})
    ctx = context(config, site, state={LEARNED_HEADS_ROUNDS: torch.tensor([1], dtype=torch.int64)})
    learned_heads.LearnedHeads().run(ctx)
    assert seen == [shift, shift]


def gates_at(ctx: RoundContext, logits: torch.Tensor) -> RoundContext:
    """`ctx` whose kept gate logits are `logits` (one row a block)."""
    names = gate_names(ctx.config)
    return replace(ctx, own={**ctx.own, **{name: logits[b].clone() for b, name in enumerate(names)}})


@pytest.mark.parametrize(
    ("toward_local", "expected"),
    [(None, 3), ((0, 2), 0)],  # every head stays shared: one more; a head moves: back to 0
)
def test_a_comparison_that_leaves_every_gate_on_its_bound_counts_toward_settling(
    site: SiteData, monkeypatch: pytest.MonkeyPatch, toward_local: tuple[int, int] | None, expected: int
) -> None:
    def preferences(model: torch.nn.Module, gates: list[torch.nn.Parameter], *_: Any) -> torch.Tensor:
        falls = torch.full((len(gates), gates[0].numel()), -0.1, dtype=torch.float64)
        if toward_local is not None:
            falls[toward_local] = 0.5
        return falls

    monkeypatch.setattr(learned_heads, "head_preferences", preferences)
    monkeypatch.setattr(learned_heads, "block_preferences", lambda model, gates, *_: torch.full((len(gates),), -0.1))
    config = study("learned_heads", {**CARVE_METHOD, "gate_bound": 1.0, "settle_after": 4, "freeze_after": 10})
    ctx = context(config, site, state=_counts(3, 2))
    ctx = gates_at(ctx, torch.full((ctx.config.n_blocks, ctx.config.n_heads), -1.0))
    outcome = learned_heads.LearnedHeads().run(ctx)
    assert int(outcome.state[LEARNED_HEADS_ROUNDS]) == 4
    assert int(outcome.state[LEARNED_HEADS_SETTLED]) == expected


def test_a_settled_site_hardens_its_gates_and_trains_on_its_whole_split(site: SiteData) -> None:
    settle = {"gate_bound": 1.0, "settle_after": 3, "freeze_after": 10}
    config = study(
        "learned_heads", {**CARVE_METHOD, **settle}, training={"lr": 0.05, "batch_size": 8}
    )  # one epoch a round
    logits = torch.full((GATED.n_blocks, GATED.n_heads), -1.0)
    logits[1, 5] = 1.0
    settled, unsettled = (
        learned_heads.LearnedHeads().run(gates_at(context(config, site, state=_counts(4, n)), logits)) for n in (3, 2)
    )
    hard = [settled.model.get_parameter(name).detach() for name in gate_names(GATED)]
    assert torch.equal(hard[0], torch.full_like(hard[0], -FROZEN_LOGIT))
    assert float(hard[1][5]) == FROZEN_LOGIT and int((hard[1] == -FROZEN_LOGIT).sum()) == GATED.n_heads - 1
    assert settled.training.samples > unsettled.training.samples  # the whole split, not four fifths
    assert int(settled.state[LEARNED_HEADS_SETTLED]) == 3


def row_keys(signals: torch.Tensor | Any) -> set[bytes]:
    """Each record's signal bytes: which records a batch holds."""
    return {bytes(memoryview(torch.as_tensor(row).numpy().tobytes())) for row in signals}


def test_the_carves_batches_see_every_gate_hard_global_and_the_rests_the_gates_as_they_are(site: SiteData) -> None:
    config = study("learned_heads", {**CARVE_METHOD, "carve_trains_shared": True}, training={"batch_size": 4})
    ctx = context(config, site)
    rest, carve = carve_validation(site.train, seed=1, fraction=0.4)
    model = ctx.build(ctx.start_state())
    gates = [model.get_parameter(name) for name in gate_names(ctx.config)]
    with torch.no_grad():
        for gate in gates:
            gate.copy_(torch.linspace(-1.0, 1.0, gate.numel()))
    kept = [gate.detach().clone() for gate in gates]
    carve_rows, rest_rows = row_keys(carve.signals), row_keys(rest.signals)
    per_epoch = -(-len(rest) // 4) + -(-len(carve) // 4)
    stream = carve_batches(ctx, rest, carve, gates)
    for _ in range(2):  # two epochs: each record once a pass, on the side it belongs to
        seen: set[bytes] = set()
        for _ in range(per_epoch):
            x, _ = next(stream)
            rows = row_keys(x)
            seen |= rows
            if rows <= carve_rows:
                assert all(bool((gate == -FROZEN_LOGIT).all()) for gate in gates)
            else:
                assert rows <= rest_rows
                assert all(torch.equal(gate, old) for gate, old in zip(gates, kept, strict=True))
        assert seen == carve_rows | rest_rows
    stream.close()
    assert all(torch.equal(gate, old) for gate, old in zip(gates, kept, strict=True))


def test_with_every_gate_hard_global_no_local_head_gets_a_gradient() -> None:
    """W_in and W_out's weight of the local heads get none; W_out's bias acts at every gate value alike."""
    model = build_model(GATED, seed=2)
    with torch.no_grad():
        for name in gate_names(GATED):
            model.get_parameter(name).fill_(-FROZEN_LOGIT)
    x, y = torch.randn(3, 12, 64), (torch.rand(3, 20) > 0.5).float()
    torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    local = [name for name in grads if LOCAL_BRANCH_PATTERN.match(name) and not name.endswith("out_proj.bias")]
    shared = [name for name in grads if ".global_branch." in name]
    assert local and shared
    assert all(grads[name] is None or not bool(grads[name].any()) for name in local)
    assert all(grads[name] is not None and bool(grads[name].any()) for name in shared)


def test_a_round_whose_carve_trains_the_shared_tensors_trains_on_every_record(site: SiteData) -> None:
    rounds = [
        learned_heads.LearnedHeads().run(
            context(
                study("learned_heads", {**CARVE_METHOD, "carve_trains_shared": on}, training={"batch_size": 4}), site
            )
        )
        for on in (False, True)
    ]
    held_out, whole = (outcome.training.samples for outcome in rounds)
    assert whole > held_out
    for outcome in rounds:  # the gates are the kept ones after training either way
        assert all(not bool(outcome.model.get_parameter(name).any()) for name in gate_names(GATED))


def test_the_probe_is_a_copy_whose_local_heads_alone_trained(site: SiteData) -> None:
    config = study("learned_heads", CARVE_METHOD, training={"lr": 0.05, "batch_size": 8})
    ctx = context(config, site)
    model = ctx.build(ctx.start_state())
    names = gate_names(ctx.config)
    with torch.no_grad():
        model.get_parameter(names[0]).fill_(-1.0)
    before = {name: value.detach().clone() for name, value in model.state_dict().items()}
    probe = local_probe(ctx, model, names, epochs=2)
    assert probe is not model
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    trained = {name for name, value in probe.named_parameters() if not torch.equal(value, before[name])}
    assert trained == {name for name in before if LOCAL_BRANCH_PATTERN.match(name)}  # BatchNorm's statistics follow
    assert all(torch.equal(probe.get_parameter(name), model.get_parameter(name)) for name in names)


def test_a_round_with_probe_epochs_compares_on_a_copy_whose_local_heads_trained(
    site: SiteData, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[torch.nn.Module] = []

    def recording(model: torch.nn.Module, gates: list[torch.nn.Parameter], *_: Any) -> torch.Tensor:
        compared.append(model)
        return torch.full((len(gates), gates[0].numel()), -0.1, dtype=torch.float64)

    monkeypatch.setattr(learned_heads, "head_preferences", recording)
    config = study("learned_heads", {**CARVE_METHOD, "probe_epochs": 1})
    ctx = context(config, site, state=_counts(1, 0))
    outcome = learned_heads.LearnedHeads().run(ctx)
    assert len(compared) == 1 and compared[0] is not outcome.model
    kept = ctx.build(ctx.start_state()).state_dict()
    probe_local = {n: v for n, v in compared[0].state_dict().items() if LOCAL_BRANCH_PATTERN.match(n)}
    assert any(not torch.equal(value, kept[name]) for name, value in probe_local.items())


def cross_fitted(site: SiteData, model_changes: dict[str, torch.Tensor] | None = None) -> tuple[Any, ...]:
    """A round's context, its model (with `model_changes` added to tensors) and the cross-fitted falls over 3 folds."""
    ctx = context(study("learned_heads", {**CARVE_METHOD, "probe_folds": 3, "probe_epochs": 1}), site)
    model = ctx.build(ctx.start_state())
    with torch.no_grad():
        for name, change in (model_changes or {}).items():
            model.get_parameter(name).add_(change)
    torch.manual_seed(0)  # dropout while the probe trains
    return ctx, model, cross_fitted_preferences(ctx, model, gate_names(ctx.config), 0.5, folds=3, epochs=1)


def test_cross_fitting_reads_each_fold_with_local_heads_that_never_trained_on_it(
    site: SiteData, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained_on: list[set[bytes]] = []
    read: list[set[bytes]] = []
    batches, heads = learned_heads._token_epochs, learned_heads.head_preferences

    def recording_batches(tokens: torch.Tensor, *args: Any) -> Any:
        trained_on.append(row_keys(tokens))
        return batches(tokens, *args)

    def recording_heads(model: torch.nn.Module, gates: list[torch.nn.Parameter], x: torch.Tensor, *args: Any) -> Any:
        read.append(row_keys(x))
        return heads(model, gates, x, *args)

    monkeypatch.setattr(learned_heads, "_token_epochs", recording_batches)
    monkeypatch.setattr(learned_heads, "head_preferences", recording_heads)
    cross_fitted(site)
    ctx, model, (falls, blocks) = cross_fitted(site)
    before = ctx.build(ctx.start_state()).state_dict()  # the model as built, before it was compared on
    assert falls.shape == (GATED.n_blocks, GATED.n_heads) and blocks.shape == (GATED.n_blocks,)
    assert len(read) == len(trained_on) == 6  # two calls of three folds
    everything = read[0] | trained_on[0]
    assert len(everything) == len(site.train)
    for fold, rest in zip(read[3:], trained_on[3:], strict=True):
        assert fold and not fold & rest and fold | rest == everything
    assert set.union(*read[3:]) == everything and sum(len(fold) for fold in read[3:]) == len(site.train)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert model.training  # not even switched to eval


def test_cross_fitting_starts_from_fresh_local_heads_not_the_kept_ones(site: SiteData) -> None:
    """The site's kept local heads do not enter the comparison (they saw every record); theta^g does."""
    _, model, (falls, blocks) = cross_fitted(site)
    local = {name: torch.randn_like(p) for name, p in model.named_parameters() if LOCAL_BRANCH_PATTERN.match(name)}
    _, _, (other_falls, other_blocks) = cross_fitted(site, local)
    assert torch.equal(falls, other_falls) and torch.equal(blocks, other_blocks)
    shared = {"blocks.0.global_branch.in_proj.weight": torch.randn_like(model.blocks[0].global_branch.in_proj.weight)}
    _, _, (moved_falls, _) = cross_fitted(site, shared)
    assert not torch.equal(falls, moved_falls)


def test_a_cross_fitted_round_holds_nothing_out(site: SiteData, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def recording(ctx: RoundContext, model: torch.nn.Module, names: tuple[str, ...], *args: Any) -> Any:
        calls.append(len(ctx.data.train))
        return torch.full((len(names), GATED.n_heads), -0.1, dtype=torch.float64), torch.full((len(names),), -0.1)

    monkeypatch.setattr(learned_heads, "cross_fitted_preferences", recording)
    config = study("learned_heads", {**CARVE_METHOD, "probe_folds": 2}, training={"batch_size": 4, "local_epochs": 1})
    outcome = learned_heads.LearnedHeads().run(context(config, site, state=_counts(1, 0)))
    assert calls == [len(site.train)]
    assert outcome.training.samples == len(site.train)  # one epoch over every record
    assert all(bool((outcome.model.get_parameter(name) == -1.0).all()) for name in gate_names(GATED))


def test_one_probe_fold_is_refused() -> None:
    with pytest.raises(ValueError, match="probe_folds"):
        LearnedHeadsParams(probe_folds=1)
    assert LearnedHeadsParams(probe_folds=2).probe_folds == 2


def test_mean_evidence_averages_every_comparison_but_the_first_skipped() -> None:
    kept: dict[str, torch.Tensor] = {}
    means, sums = [], []
    for earlier, (head, block) in enumerate([(0.3, 0.6), (0.1, 0.2), (-0.2, 0.4)]):
        falls, blocks, kept = _evidence(
            kept, torch.tensor([[head]], dtype=torch.float64), torch.tensor([block], dtype=torch.float64), earlier, 1
        )
        means.append((float(falls), float(blocks)))
        sums.append(len(kept))
    assert means == [(0.3, 0.6), (0.1, 0.2), pytest.approx((-0.05, 0.3))]
    assert sums == [0, 2, 2]  # nothing kept while the first comparison decides alone
    assert float(kept[LEARNED_HEADS_HEAD_FALLS]) == pytest.approx(-0.1)
    assert float(kept[LEARNED_HEADS_BLOCK_FALLS]) == pytest.approx(0.6)


@pytest.mark.parametrize(("evidence", "expected"), [("round", -1.0), ("mean", 1.0)])
def test_a_round_with_mean_evidence_steps_by_the_mean_of_the_kept_falls(
    site: SiteData, monkeypatch: pytest.MonkeyPatch, evidence: str, expected: float
) -> None:
    """Three rounds trained, two comparisons made, the second summed (+0.5); now -0.1: the mean, 0.2, is local."""
    shape = (GATED.n_blocks, GATED.n_heads)
    monkeypatch.setattr(learned_heads, "head_preferences", lambda *_: torch.full(shape, -0.1, dtype=torch.float64))
    monkeypatch.setattr(learned_heads, "block_preferences", lambda *_: torch.full(shape[:1], -0.1, dtype=torch.float64))
    kept = {
        LEARNED_HEADS_HEAD_FALLS: torch.full(shape, 0.5, dtype=torch.float64),
        LEARNED_HEADS_BLOCK_FALLS: torch.full(shape[:1], 0.5, dtype=torch.float64),
    }
    config = study("learned_heads", {**CARVE_METHOD, "evidence": evidence, "gate_bound": 1.0, "local_margin": 0.01})
    outcome = learned_heads.LearnedHeads().run(context(config, site, state=_counts(3, 0) | kept))
    assert all(bool((outcome.model.get_parameter(name) == expected).all()) for name in gate_names(GATED))
    if evidence == "mean":
        assert torch.allclose(outcome.state[LEARNED_HEADS_HEAD_FALLS], torch.full(shape, 0.4, dtype=torch.float64))
        assert torch.allclose(outcome.state[LEARNED_HEADS_BLOCK_FALLS], torch.full(shape[:1], 0.4, dtype=torch.float64))
    else:
        assert LEARNED_HEADS_HEAD_FALLS not in outcome.state
