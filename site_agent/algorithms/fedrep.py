"""FedRep's client (Collins et al., ICML 2021), as PFLlib `clientrep.py` runs it.

The classifier `head.*` is local (shared/algorithms/exchange.py); each round first trains the head
alone for `plocal_epochs` epochs, then the body (everything else, phi_k included) alone for the
round's steps. Each phase has its own fresh optimizer.
"""

from __future__ import annotations

from torch import nn

from shared.algorithms.exchange import model_names
from shared.algorithms.params import FedRepParams
from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome, combined
from site_agent.training import TrainResult

__all__ = ["FedRep", "train_head_then_body"]


def train_head_then_body(ctx: RoundContext, model: nn.Module, head_epochs: int) -> TrainResult:
    """Head alone for `head_epochs` epochs, then the body alone for the round's (load-scaled) steps."""
    head = model_names(ctx.config).head
    body = [name for name in model_names(ctx.config).parameters if name not in head]
    first = ctx.train(model, ctx.epoch_steps(head_epochs), trainable=head, phase="head")
    second = ctx.train(model, ctx.round_steps(), trainable=body)
    return combined(first, second)


class FedRep(ClientAlgorithm):
    """Local head, shared body; head first, then body."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One round of FedRep's two phases."""
        assert isinstance(ctx.params, FedRepParams)
        model = ctx.build(ctx.start_state())
        return RoundOutcome(model, train_head_then_body(ctx, model, ctx.params.plocal_epochs))
