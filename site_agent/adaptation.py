"""An evaluate study's site adapting the released model's local tensors (phi) before it is scored again.

A new hospital evaluates another study's final model theta^g with phi_0 (site_agent/released_evaluation.py).
With `evaluation.adapt_local_epochs` E > 0 it then trains only the local tensors of the study's exchange
(partition.local: FedDualAtt's local attention heads, and whatever else the algorithm keeps at the site)
for E epochs of its training split, as the study's `training` says, and scores theta^g with that phi on
its test split. Every shared tensor stays exactly theta^g: shared parameters are frozen (FedRep's
mechanism, RoundContext.train's `trainable`), and a BatchNorm layer whose running statistics are
shared normalises with them and never updates them (eval mode) while the rest of the model trains;
local BatchNorm statistics, where an algorithm keeps them, adapt with phi. Every random stream derives
from (study seed, site), so the same call gives the same bytes. Nothing leaves the site but the summaries.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from shared.algorithms.exchange import Exchange
from shared.model.partition import Partition
from shared.study.rules import algorithm_exchange
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from shared.wire.protocol import EvalSummary
from site_agent.algorithms.base import RoundContext, detached
from site_agent.data import SiteData
from site_agent.device import Runtime
from site_agent.local_round import LocalRoundSpec, evaluate, round_context, seeded_rng
from site_agent.released_evaluation import released_summary

__all__ = [
    "ADAPT_PHASE",
    "AdaptedEvaluation",
    "adaptation_context",
    "adapt_local",
    "evaluate_with_adaptation",
    "shared_batchnorm_held",
]

ADAPT_PHASE = "adapt"  # the random stream of the adaptation's batches: RoundContext.generator(ADAPT_PHASE)
_ROUND = 0  # an evaluate study has no rounds of its own: its seeds are those of round 0


@dataclass(frozen=True)
class AdaptedEvaluation:
    """An evaluate study's report at one site: the released model before and after adapting phi to the site."""

    before: EvalSummary  # theta^g with phi_0 on the site's test split
    after: EvalSummary | None  # theta^g with the adapted phi on the test split (None when adapt_local_epochs == 0)
    adapt_records: int | None  # training records phi was adapted on (None when not adapted)
    local: TensorDict | None  # the adapted phi (stays at the site)


def adaptation_context(
    terms: StudyTerms,
    site: str,
    *,
    global_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    data: SiteData,
    runtime: Runtime,
) -> RoundContext:
    """The adaptation as a training round: theta^g received, phi_0 as the site's own, seeded from (seed, site)."""
    spec = LocalRoundSpec.of(terms, site, _ROUND)
    exchange = algorithm_exchange(spec.site_model, terms.algorithm)
    return round_context(
        spec, exchange, global_tensors, initial_local, data, runtime, label=f"{site} adaptation"
    )  # ValueError: the released tensors are not the study's exchange


def _eval_mode(module: nn.Module, _inputs: tuple[object, ...]) -> None:
    """A forward pre-hook: the layer runs in eval mode whatever mode its model is in."""
    module.training = False


def _holds_shared_statistics(prefix: str, module: nn.Module, partition: Partition) -> bool:
    """Whether `module` is a BatchNorm layer with running statistics (or step count) among the shared names."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False
    return any(not partition.is_local(f"{prefix}.{name}") for name, _ in module.named_buffers(recurse=False))


@contextmanager
def shared_batchnorm_held(model: nn.Module, partition: Partition) -> Iterator[None]:
    """Inside, every BatchNorm layer with shared statistics normalises with them and leaves them as they are."""
    held = [m for prefix, m in model.named_modules() if _holds_shared_statistics(prefix, m, partition)]
    handles = [module.register_forward_pre_hook(_eval_mode) for module in held]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _trainable(model: nn.Module, exchange: Exchange) -> list[str]:
    """The local parameters of `model`: phi, the only tensors adaptation trains."""
    return [name for name, _ in model.named_parameters() if exchange.partition.is_local(name)]


def adapt_local(ctx: RoundContext, epochs: int) -> nn.Module:
    """theta^g with phi_0 (the released evaluation model) whose phi was trained for `epochs` epochs; theta^g intact.

    Call it inside `seeded_rng(ctx.seed, ...)`: dropout draws from torch's global stream.
    """
    if epochs < 1:
        raise ValueError(f"adaptation needs at least one epoch, got {epochs}")
    if len(ctx.data.train) == 0:
        raise ValueError(f"{ctx.label}: the site has no training records to adapt the local tensors on")
    model = ctx.build(ctx.exchange.global_evaluation_state(ctx.received, ctx.own, ctx.own))
    trainable = _trainable(model, ctx.exchange)
    if not trainable:
        raise ValueError(f"{ctx.label}: the study's model has no local parameters to adapt")
    start = model.state_dict()
    shared = {name: start[name].detach().clone() for name in ctx.exchange.partition.shared}
    with shared_batchnorm_held(model, ctx.exchange.partition):
        ctx.train(model, ctx.epoch_steps(epochs), trainable=trainable, phase=ADAPT_PHASE)
    model.eval()
    after = model.state_dict()
    moved = [name for name, tensor in shared.items() if not torch.equal(after[name], tensor)]
    if moved:
        raise RuntimeError(f"adapting the local tensors changed shared tensors: {moved[:5]}")
    return model


def evaluate_with_adaptation(
    terms: StudyTerms,
    site: str,
    *,
    global_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    data: SiteData,
    runtime: Runtime,
) -> AdaptedEvaluation:
    """An evaluate study at `site`: theta^g with phi_0 on the test split, then (E > 0) with phi adapted to the site."""
    if terms.kind != "evaluate" or terms.evaluation is None:
        raise ValueError(f"only an evaluate study adapts a released model; this one is a {terms.kind} study")
    epochs = terms.evaluation.adapt_local_epochs
    if len(data.test) == 0:
        raise ValueError(f"site {site} has no test records to evaluate the released model on")
    if epochs > 0 and len(data.train) == 0:
        raise ValueError(f"site {site} has no training records to adapt the local tensors on ({epochs} epochs)")
    before = released_summary(
        terms,
        site,
        _ROUND,
        global_tensors=global_tensors,
        initial_local=initial_local,
        splits=[data.test],
        runtime=runtime,
    )
    if epochs == 0:
        return AdaptedEvaluation(before, None, None, None)
    ctx = adaptation_context(
        terms, site, global_tensors=global_tensors, initial_local=initial_local, data=data, runtime=runtime
    )
    with seeded_rng(ctx.seed, runtime):
        model = adapt_local(ctx, epochs)
        predictions = evaluate(model, data.test, runtime)
    after = predictions.summary(terms.privacy, ctx.seed)
    state = model.state_dict()
    local = detached({name: state[name] for name in ctx.exchange.partition.local})
    return AdaptedEvaluation(before, after, len(data.train), local)
