"""FedAH's client (Aggregated Head; papers/004; heyuepeng/FedAH `clientah.py`).

The body comes from theta^g_{t-1}; the head starts as the aggregated head
h_l + (h_g - h_l) * W, W (head-shaped, from ones, kept across rounds) learned for
`plocal_epochs` epochs over the shuffled training split with the body frozen, at learning rate
`eta` (the code's 1.0) or, with `eta_is_local_lr`, the training lr (the paper's setting). Then
FedRep's phases: head alone for `plocal_epochs` epochs, body alone for the round's steps. The whole model
(head included) is uploaded and averaged; the site keeps its head h_l and W. BatchNorm statistics
stay local (the FedAH code exchanges parameters only).
"""

from __future__ import annotations

from torch import nn

from shared.algorithms.exchange import FEDAH_HEAD, FEDAH_WEIGHT, model_names
from shared.algorithms.params import FedAHParams
from shared.tensors.codec import TensorDict
from site_agent.algorithms.adaptive import initial_weight, learn_mix_weights
from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome, detached
from site_agent.algorithms.fedrep import train_head_then_body

__all__ = ["FedAH", "aggregated_head"]


def aggregated_head(ctx: RoundContext) -> tuple[TensorDict, TensorDict]:
    """(the round's start state with the aggregated head, the learned W)."""
    params = ctx.params
    assert isinstance(params, FedAHParams)
    head = model_names(ctx.config).head
    start = ctx.start_state()
    device = ctx.runtime.device
    own = ctx.kept(FEDAH_HEAD, head) or {name: ctx.received[name] for name in head}  # first round: h_l = h_g
    kept_weights = ctx.kept(FEDAH_WEIGHT, head)
    weights = {name: initial_weight(kept_weights, own, name).to(device) for name in head}
    temporary = ctx.build(start)
    learn_mix_weights(
        temporary,
        head,
        {name: own[name].to(device) for name in head},
        {name: ctx.received[name].to(device) for name in head},
        weights,
        ctx.epoch("fedah.weights", drop_last=True),
        eta=ctx.training.lr if params.eta_is_local_lr else params.eta,
        done=lambda losses: len(losses) >= params.plocal_epochs,
        runtime=ctx.runtime,
        stop=ctx.stop,
    )
    learned = dict(temporary.named_parameters())
    return {**start, **detached({name: learned[name] for name in head})}, detached(weights)


class FedAH(ClientAlgorithm):
    """Aggregated head, then head-then-body training; keeps h_l and W."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One FedAH round."""
        assert isinstance(ctx.params, FedAHParams)
        start, weights = aggregated_head(ctx)
        model = ctx.build(start)
        result = train_head_then_body(ctx, model, ctx.params.plocal_epochs)
        head = model_names(ctx.config).head
        trained = dict(model.named_parameters())
        state = {**detached({name: trained[name] for name in head}, FEDAH_HEAD), **detached(weights, FEDAH_WEIGHT)}
        return RoundOutcome(model, result, state=state)

    def personal_model(self, ctx: RoundContext) -> nn.Module:
        """theta^g_T's body with the aggregated head (W is not kept)."""
        return ctx.build(aggregated_head(ctx)[0])
