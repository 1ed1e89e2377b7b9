"""Scaffold's client (Karimireddy et al., 2020; arXiv:1910.06378), option II control variates.

Every step's gradient of each shared parameter is corrected in place, grad += c - c_k, before the
optimizer step. After K steps with learning rate lr: c_k+ = c_k - c + (x - y) / (K lr); the site
uploads y and delta c_k = c_k+ - c_k and keeps c_k+.

FedCVD's `scaffold.py` writes its correction into `model.state_dict().values()`, detached tensors
whose `.grad` is always None, so there the correction is a no-op and "Scaffold" is unweighted
FedAvg. This client applies it to the real parameter gradients; `scaffold_fedcvd` is the same
client without the correction (its control variates are still computed and exchanged, as FedCVD's).
"""

from __future__ import annotations

import torch

from shared.algorithms.exchange import SCAFFOLD_C, SCAFFOLD_C_K, SCAFFOLD_DELTA_C
from site_agent.algorithms.base import ClientAlgorithm, RoundContext, RoundOutcome, detached

__all__ = ["Scaffold"]


class Scaffold(ClientAlgorithm):
    """Local training with the control-variate correction; uploads delta c_k besides the model."""

    def __init__(self, *, corrects_gradients: bool = True) -> None:
        self.corrects_gradients = corrects_gradients  # False: FedCVD's Scaffold, plain local SGD

    def run(self, ctx: RoundContext) -> RoundOutcome:
        """One corrected round, then the new c_k."""
        model = ctx.build(ctx.start_state())
        device = ctx.runtime.device
        names = ctx.exchange.shared_parameters(ctx.config)
        parameters = dict(model.named_parameters())
        c = {name: ctx.server_state[SCAFFOLD_C + name].to(device) for name in names}
        kept = ctx.kept(SCAFFOLD_C_K, names)
        c_k = {name: kept[name].to(device) for name in names} if kept is not None else _zeros_like(c)
        correction = {name: c[name] - c_k[name] for name in names}
        start = {name: parameters[name].detach().clone() for name in names}

        def correct() -> None:
            for name in names:
                grad = parameters[name].grad
                if grad is not None:
                    grad.add_(correction[name])

        result = ctx.train(model, ctx.round_steps(), grad_hooks=[correct] if self.corrects_gradients else [])
        scale = 1.0 / (result.steps * ctx.training.lr)
        with torch.no_grad():
            new_c_k = {name: c_k[name] - c[name] + (start[name] - parameters[name]) * scale for name in names}
            delta = {name: new_c_k[name] - c_k[name] for name in names}
        return RoundOutcome(
            model, result, state=detached(new_c_k, SCAFFOLD_C_K), uploads=detached(delta, SCAFFOLD_DELTA_C)
        )


def _zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in tensors.items()}
