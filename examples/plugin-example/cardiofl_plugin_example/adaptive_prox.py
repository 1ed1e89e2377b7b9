"""The rule cardiofl's registry reads through the `cardiofl.algorithms` entry point: params and exchange."""

from __future__ import annotations

from dataclasses import replace

import torch
from pydantic import BaseModel, ConfigDict, Field

from shared.algorithms import exchange
from shared.algorithms.exchange import Exchange
from shared.algorithms.rule import Algorithm
from shared.tensors.codec import TensorSpec
from shared.terms.model_config import ModelConfig

__all__ = ["MU", "LOSS", "FALLING", "AdaptiveProxParams", "RULE"]

MU = "adaptive_prox.mu"  # the site's current proximal weight
LOSS = "adaptive_prox.loss"  # its previous round's training loss (NaN before the first)
FALLING = "adaptive_prox.falling"  # how many rounds in a row its loss fell


class AdaptiveProxParams(BaseModel):
    """mu to start from, the step it moves by, and the falling rounds before it shrinks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mu: float = Field(0.01, ge=0, le=100)
    step: float = Field(0.1, gt=0, le=100)
    patience: int = Field(5, ge=1, le=1000)


def adaptive_exchange(config: ModelConfig, params: BaseModel) -> Exchange:
    """The model's own partition as FedProx's, with the site's mu, last loss and falling count kept as its own."""
    base = exchange.model_partition_as_is(config, params)
    state = {
        MU: TensorSpec((1,), torch.float64),
        LOSS: TensorSpec((1,), torch.float64),
        FALLING: TensorSpec((1,), torch.int64),
    }
    return replace(base, site_state=state)


RULE = Algorithm(AdaptiveProxParams, adaptive_exchange)  # its client: the `cardiofl.clients` entry point
