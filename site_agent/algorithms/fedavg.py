"""FedAvg's client (McMahan et al., 2017): plain local training of theta^g_{t-1} with phi_k.

With the dual-attention partition this is FedDualAtt; with FedBN's or FedPer's partition (BN
layers or the classifier local, shared/algorithms/exchange.py) it is FedBN's and FedPer's client.
"""

from __future__ import annotations

from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome

__all__ = ["FedAvg"]


class FedAvg(ClientAlgorithm):
    """Train every parameter for the round's steps; upload the shared tensors."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One round of local SGD (or the configured optimizer)."""
        model = ctx.build(ctx.start_state())
        return RoundOutcome(model, ctx.train(model, ctx.round_steps()))
