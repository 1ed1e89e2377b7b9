"""Ditto's client (Li et al., 2021; arXiv:2012.04221), as FedCVD runs it.

Each round the site trains the received model (theta^g_{t-1} with phi_k) with the plain loss and
uploads it, then trains its persistent personal model v_k for as many steps with loss +
(mu/2) * ||v - w_received||^2. v_k (the whole model state) stays in the site's encrypted store
and is the model the site evaluates as its own.
"""

from __future__ import annotations

from torch import nn

from shared.algorithms.exchange import DITTO_PERSONAL
from shared.algorithms.params import DittoParams
from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome, combined, detached
from site_agent.algorithms.fedprox import proximal_term

__all__ = ["Ditto"]


class Ditto(ClientAlgorithm):
    """The global model's round, then the personal model's proximal round."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """Train w (uploaded), then v_k (kept and evaluated)."""
        assert isinstance(ctx.params, DittoParams)
        model = ctx.build(ctx.start_state())
        received = {name: p.detach().clone() for name, p in model.named_parameters()}
        first = ctx.train(model, ctx.round_steps())
        personal = self.personal_model(ctx)
        pairs = [(p, received[name]) for name, p in personal.named_parameters()]
        prox = proximal_term(pairs, ctx.params.mu)
        second = ctx.train(personal, ctx.round_steps(), loss_terms=[prox], phase="personal")
        return RoundOutcome(
            model, combined(first, second), personal=personal, state=detached(personal.state_dict(), DITTO_PERSONAL)
        )

    def personal_model(self, ctx: RoundContext) -> nn.Module:
        """v_k from the store; before its first round, the received model."""
        kept = ctx.kept(DITTO_PERSONAL, ctx.exchange.schema)
        return ctx.build(kept if kept is not None else ctx.start_state())
