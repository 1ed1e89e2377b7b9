"""The site's side: FedProx's round at the site's own mu, then mu moved by how the round's loss went."""

from __future__ import annotations

import math

import torch

from cardiofl_plugin_example.adaptive_prox import FALLING, LOSS, MU, AdaptiveProxParams
from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome
from site_agent.algorithms.fedprox import proximal_term

__all__ = ["CLIENT", "AdaptiveFedProx", "next_mu"]


def next_mu(
    mu: float, previous_loss: float, loss: float, falling: int, params: AdaptiveProxParams
) -> tuple[float, int]:
    """(mu, falling) after a round: up a step when the loss rose, down a step after `patience` falls in a row."""
    if math.isnan(previous_loss):
        return mu, 0
    if loss > previous_loss:
        return mu + params.step, 0
    falling += 1
    if falling >= params.patience:
        return max(0.0, mu - params.step), 0
    return mu, falling


class AdaptiveFedProx(ClientAlgorithm):
    """FedProx with the proximal weight read from, and written back to, the site's private state."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One round of local training with the site's mu, and the site's next mu kept."""
        assert isinstance(ctx.params, AdaptiveProxParams)
        kept = ctx.state
        mu = float(kept[MU]) if MU in kept else ctx.params.mu
        previous = float(kept[LOSS]) if LOSS in kept else math.nan
        falling = int(kept[FALLING]) if FALLING in kept else 0
        model = ctx.build(ctx.start_state())
        shared = set(ctx.exchange.partition.shared)
        pairs = [(p, p.detach().clone()) for name, p in model.named_parameters() if name in shared]
        result = ctx.train(model, ctx.round_steps(), loss_terms=[proximal_term(pairs, mu)])
        mu, falling = next_mu(mu, previous, result.loss, falling, ctx.params)
        state = {
            MU: torch.tensor([mu], dtype=torch.float64),
            LOSS: torch.tensor([result.loss], dtype=torch.float64),
            FALLING: torch.tensor([falling], dtype=torch.int64),
        }
        return RoundOutcome(model, result, state=state)


CLIENT = AdaptiveFedProx()
