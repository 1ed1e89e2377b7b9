"""Learned head assignment's client (issues #19, #33): local training of theta^g and phi_k, and the gates' update.

Two ways to move the gates (shared/algorithms/learned_heads.py), `gate_update` in the study's terms:

- "validation" (default): the gates take no gradient. From its second round on, a site first holds
  out a fixed validation carve of its training split (`validation_fraction`) and, for every head,
  compares the validation loss with that head local (g = 1) against global (g = 0), the other gates
  as they are, on theta^g_{t-1} and phi_k as received and kept: the choice the site actually has.
  It also compares each block with all its heads local against all global (with `gate_test` "step":
  the logits one `gate_step` lower against one higher, where the mix stands). Each gate logit steps
  by `gate_step` toward local where local lowers the loss by more than `local_margin` (relative),
  or where it lowers it at all and the whole block local lowers it by more than `block_margin`
  (once most of a block is local, one more head adds little alone although the block as a whole is
  clearly better local; a head alone must clear the higher bar, so that noise at a site whose heads
  are best shared does not carry it), else toward
  global, and stays within +-`gate_bound`; then the site trains everything but the gates on the
  rest of its split. Two options make the comparison fairer and cheaper: with `probe_epochs` the
  comparisons read a copy of the model whose local heads alone first trained that many epochs on
  the rest, every gate hard local (a head trained only as a share of a mix looks worse local than
  it would be); with `carve_trains_shared` the carve's records also train the shared tensors,
  through the global heads alone (every gate hard global on their batches), so they still never
  reach a local head but holding them out costs the site's shared model nothing. With `probe_folds`
  nothing is held out: the comparisons are cross-fitted over that many folds of the whole split, each
  fold read by fresh local heads (phi_0's) that trained `probe_epochs` epochs on the other folds, so
  a small site's choice rests on all its records, none of them seen by the heads that read it (the
  kept local heads saw them all). With `evidence = "mean"` the gates step by the mean of every
  comparison's falls so far (but the first `evidence_skip`), kept at the site, not by this round's
  alone. Sharing is the
  default because it costs a site little when it is right and helps the others; the training
  loss cannot choose instead, since a local head fits the site's own training data at least as
  well as the averaged one, so its gradient leans toward local whatever the truth.
- "gradient": the gates train with the model on the training loss plus `gate_penalty` x their mean
  binary entropy (issue #19's method).

Either way, once the site has trained `freeze_after` rounds, every gate is hardened to 0/1 and left
out of training; with the validation gates also once `settle_after` comparisons in a row have left
every gate logit where it was, on its bound (a site that has decided stops holding records out); a
logit at exactly 0 goes to `undecided`. The counts are kept at the site beside phi_k.
"""

from __future__ import annotations

import copy
from collections.abc import Generator, Iterator, Sequence
from dataclasses import replace
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.algorithms.exchange import (
    LEARNED_HEADS_BLOCK_FALLS,
    LEARNED_HEADS_HEAD_FALLS,
    LEARNED_HEADS_ROUNDS,
    LEARNED_HEADS_SETTLED,
)
from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_entropy, gate_names, hardened
from shared.algorithms.params import LearnedHeadsParams
from shared.model.network import DualAttentionResNet1D, build_model
from shared.tensors.codec import TensorDict
from site_agent.algorithms.base import (
    ClientAlgorithm,
    LossTerm,
    RoundContext,
    RoundOutcome,
    batches_per_epoch,
    steps_for,
)
from site_agent.algorithms.uncertainty import validation_seed
from site_agent.data import SplitArrays
from site_agent.data.loader import carve_validation
from site_agent.training import Batch, cycle_batches

__all__ = ["LearnedHeads", "block_preferences", "carve_batches", "gate_penalty", "head_preferences", "local_probe"]


def gate_penalty(gates: Sequence[Tensor], strength: float) -> LossTerm:
    """The loss term: strength x the mean binary entropy of the gates sigmoid(z), at each step."""

    def term() -> Tensor:
        return strength * torch.cat([gate_entropy(z) for z in gates]).mean()

    return term


@torch.no_grad()
def _loss(model: nn.Module, x: Tensor, y: Tensor) -> float:
    return float(F.binary_cross_entropy_with_logits(model(x).float(), y))


def _fall_when_local(
    model: nn.Module, x: Tensor, y: Tensor, gate: nn.Parameter, heads: int | slice, shift: float | None
) -> float:
    """(loss(heads global) - loss(heads local)) / loss(heads global), the other gates as they are; gate restored.

    Global and local are the hard gates (`shift` None), or the heads' logits moved by `shift` down and up.
    """
    kept = gate[heads].clone()
    gate[heads] = -FROZEN_LOGIT if shift is None else kept - shift
    shared = _loss(model, x, y)
    gate[heads] = FROZEN_LOGIT if shift is None else kept + shift
    fall = (shared - _loss(model, x, y)) / shared
    gate[heads] = kept
    return fall


@torch.no_grad()
def head_preferences(
    model: nn.Module, gates: list[nn.Parameter], x: Tensor, y: Tensor, shift: float | None = None
) -> Tensor:
    """(blocks, H): the relative fall of the validation loss with each head local rather than global.

    Local and global are the hard gates, or with `shift` the head's logit `shift` above rather than
    below where it stands. Per head, the other gates as they are: positive where the head does better
    local. `model` is evaluated (no dropout), and every gate is restored afterwards.
    """
    model.eval()
    preferences = torch.zeros(len(gates), gates[0].numel(), dtype=torch.float64)
    for b, gate in enumerate(gates):
        for h in range(gate.numel()):
            preferences[b, h] = _fall_when_local(model, x, y, gate, h, shift)
    return preferences


@torch.no_grad()
def block_preferences(
    model: nn.Module, gates: list[nn.Parameter], x: Tensor, y: Tensor, shift: float | None = None
) -> Tensor:
    """(blocks,): the relative fall of the validation loss with all of a block's heads local rather than global.

    The other blocks' gates as they are; `model` is evaluated (no dropout), and every gate is restored.
    """
    model.eval()
    preferences = torch.zeros(len(gates), dtype=torch.float64)
    for b, gate in enumerate(gates):
        preferences[b] = _fall_when_local(model, x, y, gate, slice(None), shift)
    return preferences


def _stepped(logits: Tensor, preference: Tensor, block: float, params: LearnedHeadsParams) -> Tensor:
    """Gate logits one step toward local where the head or its block prefers local (module doc), else toward global.

    |z| stays within gate_bound. `preference` holds the block's heads' falls, `block` the block's.
    """
    own = preference > params.local_margin
    shared_fall = block > params.block_margin
    toward = torch.where(own | (shared_fall & (preference > 0)), 1.0, -1.0).to(logits.dtype)
    return (logits + params.gate_step * toward).clamp(-params.gate_bound, params.gate_bound)


_COUNTS = (LEARNED_HEADS_ROUNDS, LEARNED_HEADS_SETTLED)


def _counts(trained: int, settled: int) -> dict[str, Tensor]:
    """The site's kept counts: rounds trained, and comparisons in a row that left every gate at rest on its bound."""
    return {
        name: torch.tensor([count], dtype=torch.int64) for name, count in zip(_COUNTS, (trained, settled), strict=True)
    }


def _evidence(
    kept: TensorDict, preferences: Tensor, blocks: Tensor, earlier: int, skip: int
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The mean head and block falls of this comparison and the kept ones, and the sums to keep.

    `earlier` comparisons were made before this one (a site compares in every round but its first until
    its gates freeze); the first `skip` are not summed, and while they are made, this one's falls decide alone.
    """
    if earlier < skip:
        return preferences, blocks, {}
    head_sum = kept.get(LEARNED_HEADS_HEAD_FALLS, torch.zeros_like(preferences)) + preferences
    block_sum = kept.get(LEARNED_HEADS_BLOCK_FALLS, torch.zeros_like(blocks)) + blocks
    counted = earlier - skip + 1
    sums = {
        LEARNED_HEADS_HEAD_FALLS: head_sum.to(torch.float64),
        LEARNED_HEADS_BLOCK_FALLS: block_sum.to(torch.float64),
    }
    return head_sum / counted, block_sum / counted, sums


def _at_rest(before: list[Tensor], after: list[nn.Parameter], bound: float) -> bool:
    """Whether a comparison left every gate logit where it was, at +-bound."""
    return all(
        torch.equal(old, new) and bool((new.abs() == bound).all()) for old, new in zip(before, after, strict=True)
    )


def _arrays(split: SplitArrays) -> tuple[Tensor, Tensor]:
    """The whole split in memory (a validation carve is small)."""
    rows = np.arange(len(split))
    return torch.as_tensor(np.asarray(split.signals[rows])), torch.as_tensor(np.asarray(split.labels))


def _set_gates(gates: list[nn.Parameter], logits: list[Tensor]) -> None:
    """Every gate's logits from `logits`, in place."""
    with torch.no_grad():
        for gate, values in zip(gates, logits, strict=True):
            gate.copy_(values)


def carve_batches(
    ctx: RoundContext, rest: SplitArrays, carve: SplitArrays, gates: list[nn.Parameter]
) -> Generator[Batch, None, None]:
    """Endless batches of the rest and the carve, in a seeded order each epoch; every gate hard global on the carve's.

    The rest's batches see the gates as they are; the carve's records train the shared tensors and reach no local
    head. The gates are as they were again once the stream is closed.
    """
    kept = [gate.detach().clone() for gate in gates]
    logits = (kept, [torch.full_like(values, -FROZEN_LOGIT) for values in kept])  # by part: rest, carve
    epochs = (ctx.epoch("", split=rest), ctx.epoch("carve", split=carve))
    counts = [batches_per_epoch(len(part), ctx.training) for part in (rest, carve)]
    parts = torch.repeat_interleave(torch.arange(2), torch.tensor(counts))  # each batch's part, before shuffling
    order = ctx.generator("carve order")
    try:
        while True:
            streams = [iter(epoch()) for epoch in epochs]  # read lazily, a batch at a time
            for part in parts[torch.randperm(len(parts), generator=order)].tolist():
                _set_gates(gates, logits[part])
                yield next(streams[part])
    finally:
        _set_gates(gates, kept)


def local_probe(fitting: RoundContext, model: nn.Module, names: tuple[str, ...], epochs: int) -> nn.Module:
    """A copy of `model` whose local heads (phi_k but the gates) alone trained `epochs` epochs on `fitting`'s split.

    Every gate is hard local while they train and `model`'s again afterwards (the copy's BatchNorm statistics have
    followed the batches); `model` is not changed.
    """
    probe = copy.deepcopy(model)
    gates = [probe.get_parameter(name) for name in names]
    kept = [gate.detach().clone() for gate in gates]
    _set_gates(gates, [torch.full_like(logits, FROZEN_LOGIT) for logits in kept])
    heads = [name for name in fitting.exchange.partition.local if name not in names]  # phi_k but the gates
    fitting.train(probe, fitting.epoch_steps(epochs), trainable=heads, phase="tune")
    _set_gates(gates, kept)
    return probe


class OnTokens(nn.Module):
    """A DualAttentionResNet1D read from its backbone's tokens: the blocks, the pool and the classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        # build_model returns an nn.Module; a model with head gates is a DualAttentionResNet1D (or one shaped like it).
        self.model = cast(DualAttentionResNet1D, model)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits (B, n_classes) of position-encoded tokens (B, T, D)."""
        logits: Tensor = self.model.head(self.model.head_dropout(self.model.attended(tokens)))
        return logits


def _token_epochs(tokens: Tensor, labels: Tensor, batch_size: int, generator: torch.Generator) -> Iterator[Batch]:
    """Endless batches of (tokens, labels), in a new seeded order each epoch."""

    def epoch() -> Iterator[Batch]:
        order = torch.randperm(len(tokens), generator=generator).to(tokens.device)
        return ((tokens[rows], labels[rows]) for rows in torch.split(order, batch_size))

    return cycle_batches(epoch)


def cross_fitted_preferences(
    ctx: RoundContext, model: nn.Module, names: tuple[str, ...], shift: float | None, folds: int, epochs: int
) -> tuple[Tensor, Tensor]:
    """The head and block preferences over the whole split, each fold read by local heads that never saw it.

    The split's records fall into `folds` seeded folds (the same every round). For each, a copy of `model`
    gets fresh local heads (phi_0's, but the gates), which train `epochs` epochs on the other folds' records,
    every gate hard local; then `head_preferences` and `block_preferences` read the fold with the gates as
    they are. The folds' preferences are averaged by their records. Only the blocks and the classifier
    run: the backbone's tokens are computed once, in eval mode. `model` is not changed.
    """
    x, y = (t.to(ctx.runtime.device) for t in _arrays(ctx.data.train))
    probe = OnTokens(copy.deepcopy(model))
    with torch.no_grad():
        tokens = probe.model.eval().tokens(x)
    gates = [probe.model.get_parameter(name) for name in names]
    kept = [gate.detach().clone() for gate in gates]
    heads = [name for name in ctx.exchange.partition.local if name not in names]  # phi_k but the gates
    fresh = build_model(ctx.config, seed=ctx.model_seed).state_dict()  # phi_0, as every site started
    seed = validation_seed(ctx.model_seed, "learned_heads folds")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed)).to(x.device)
    head_sum = torch.zeros(len(gates), gates[0].numel(), dtype=torch.float64)
    block_sum = torch.zeros(len(gates), dtype=torch.float64)
    for index, rows in enumerate(order.tensor_split(min(folds, len(x)))):
        rest = order[~torch.isin(order, rows)]
        with torch.no_grad():
            for name in heads:
                probe.model.get_parameter(name).copy_(fresh[name])
        _set_gates(gates, [torch.full_like(logits, FROZEN_LOGIT) for logits in kept])
        steps = epochs * batches_per_epoch(len(rest), ctx.training)  # as local_probe's epochs count them
        stream = _token_epochs(tokens[rest], y[rest], ctx.training.batch_size, ctx.generator(f"fold {index}"))
        ctx.train(probe, steps, trainable=[f"model.{name}" for name in heads], phase=f"fold {index}", batches=stream)
        _set_gates(gates, kept)
        head_sum += len(rows) * head_preferences(probe, gates, tokens[rows], y[rows], shift)
        block_sum += len(rows) * block_preferences(probe, gates, tokens[rows], y[rows], shift)
    return head_sum / len(x), block_sum / len(x)


class LearnedHeads(ClientAlgorithm):
    """FedAvg's round of the gated model, then the gates' step; or with the gates frozen hard."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One round of local training; the gates are hardened first once the site has trained freeze_after rounds."""
        assert isinstance(ctx.params, LearnedHeadsParams)
        params = ctx.params
        trained, settled = (int(ctx.state[name].item()) if name in ctx.state else 0 for name in _COUNTS)
        frozen = (params.freeze_after is not None and trained >= params.freeze_after) or (
            params.settle_after is not None and settled >= params.settle_after
        )
        model = ctx.build(ctx.start_state())
        names = gate_names(ctx.config)
        gates = [model.get_parameter(name) for name in names]
        others = [name for name, _ in model.named_parameters() if name not in names]
        state = _counts(trained + 1, settled)
        if frozen:
            _set_gates(gates, [hardened(gate, params.undecided) for gate in gates])
            return RoundOutcome(model, ctx.train(model, ctx.round_steps(), trainable=others), state=state)
        if params.gate_update == "gradient":
            terms = [gate_penalty(gates, params.gate_penalty)] if params.gate_penalty > 0 else []
            return RoundOutcome(model, ctx.train(model, ctx.round_steps(), loss_terms=terms), state=state)
        shift = params.gate_step if params.gate_test == "step" else None
        if params.probe_folds:  # cross-fitted: nothing held out
            train, validation = ctx.data.train, None
        else:
            seed = validation_seed(ctx.model_seed, "learned_heads")
            train, validation = carve_validation(ctx.data.train, seed=seed, fraction=params.validation_fraction)
        fitting = replace(ctx, data=replace(ctx.data, train=train))
        if trained > 0:  # theta^g_{t-1}'s heads against the site's own: at the first round both are untrained
            if validation is None:
                preferences, blocks = cross_fitted_preferences(
                    ctx, model, names, shift, params.probe_folds, params.probe_epochs
                )
            else:
                x, y = (t.to(ctx.runtime.device) for t in _arrays(validation))
                probe = local_probe(fitting, model, names, params.probe_epochs) if params.probe_epochs else model
                probe_gates = [probe.get_parameter(name) for name in names]
                preferences = head_preferences(probe, probe_gates, x, y, shift)
                blocks = block_preferences(probe, probe_gates, x, y, shift)
            evidence: dict[str, Tensor] = {}
            if params.evidence == "mean":
                preferences, blocks, evidence = _evidence(
                    ctx.state, preferences, blocks, trained - 1, params.evidence_skip
                )
            with torch.no_grad():
                before = [gate.detach().clone() for gate in gates]
                for gate, preference, block in zip(gates, preferences, blocks.tolist(), strict=True):
                    gate.copy_(_stepped(gate, preference, block, params))
            state = _counts(trained + 1, settled + 1 if _at_rest(before, gates, params.gate_bound) else 0) | evidence
        if validation is None or not params.carve_trains_shared:
            return RoundOutcome(model, fitting.train(model, fitting.round_steps(), trainable=others), state=state)
        steps = sum(steps_for(len(part), ctx.training, ctx.load_factor) for part in (train, validation))
        batches = carve_batches(ctx, train, validation, gates)
        try:
            result = ctx.train(model, steps, trainable=others, batches=batches)
        finally:
            batches.close()
        return RoundOutcome(model, result, state=state)
