"""Learned head assignment's client (issue #19): local training of theta^g and phi_k with gates pushed toward 0 or 1.

The loss is the site's BCE plus `gate_penalty` x the mean binary entropy of its gates; once the site
has trained `freeze_after` rounds, its gates are hardened to 0/1 and left out of training
(shared/algorithms/learned_heads.py). The round count is kept at the site beside phi_k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.algorithms.exchange import LEARNED_HEADS_ROUNDS
from shared.algorithms.learned_heads import gate_entropy, gate_names, hardened
from shared.algorithms.params import LearnedHeadsParams
from site_agent.algorithms.base import ClientAlgorithm, LossTerm, RoundContext, RoundOutcome

__all__ = ["LearnedHeads", "gate_penalty"]


def gate_penalty(gates: list[Tensor], strength: float) -> LossTerm:
    """The loss term: strength x the mean binary entropy of the gates sigmoid(z), at each step."""

    def term() -> Tensor:
        return strength * torch.cat([gate_entropy(z) for z in gates]).mean()

    return term


class LearnedHeads(ClientAlgorithm):
    """FedAvg's round of the gated model, plus the gates' entropy penalty, or with its gates frozen hard."""

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One round of local training; the gates are hardened first once the site has trained freeze_after rounds."""
        assert isinstance(ctx.params, LearnedHeadsParams)
        trained = int(ctx.state[LEARNED_HEADS_ROUNDS].item()) if LEARNED_HEADS_ROUNDS in ctx.state else 0
        frozen = ctx.params.freeze_after is not None and trained >= ctx.params.freeze_after
        model = ctx.build(ctx.start_state())
        names = gate_names(ctx.config)
        gates = [model.get_parameter(name) for name in names]
        if frozen:
            with torch.no_grad():
                for gate in gates:
                    gate.copy_(hardened(gate))
            trainable = [name for name, _ in model.named_parameters() if name not in names]
            result = ctx.train(model, ctx.round_steps(), trainable=trainable)
        else:
            terms = [gate_penalty(gates, ctx.params.gate_penalty)] if ctx.params.gate_penalty > 0 else []
            result = ctx.train(model, ctx.round_steps(), loss_terms=terms)
        state = {LEARNED_HEADS_ROUNDS: torch.tensor([trained + 1], dtype=torch.int64)}
        return RoundOutcome(model, result, state=state)
