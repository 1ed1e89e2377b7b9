"""FedProx's client (Li et al., 2020; arXiv:1812.06127): local loss + (mu/2) * ||w - w_global||^2.

The proximal term covers the shared parameters (the global model w^t); phi_k has no global
counterpart. With mu = 0 a round is bit-identical to FedAvg's.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from shared.algorithms.params import FedProxParams
from site_agent.algorithms.base import ClientAlgorithm, LossTerm, RoundContext, RoundOutcome

__all__ = ["FedProx", "proximal_term"]


def proximal_term(pairs: Sequence[tuple[Tensor, Tensor]], mu: float) -> LossTerm:
    """(mu/2) * Σ ||p - anchor||^2 over (parameter, fixed anchor) pairs, evaluated at each step."""

    def term() -> Tensor:
        return (mu / 2) * sum((p - anchor).pow(2).sum() for p, anchor in pairs)  # type: ignore[return-value]

    return term


class FedProx(ClientAlgorithm):
    """FedAvg's round with the proximal term pulling the shared parameters toward theta^g_{t-1}."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One round of local training with the proximal term."""
        assert isinstance(ctx.params, FedProxParams)
        model = ctx.build(ctx.start_state())
        shared = set(ctx.exchange.partition.shared)
        pairs = [(p, p.detach().clone()) for name, p in model.named_parameters() if name in shared]
        result = ctx.train(model, ctx.round_steps(), loss_terms=[proximal_term(pairs, ctx.params.mu)])
        return RoundOutcome(model, result)
