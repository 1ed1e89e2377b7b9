"""A client algorithm as both sides see it: the rule object an entry point of `cardiofl.algorithms` names.

Its client side is a `cardiofl.clients` entry point of the same name and the same distribution, which only
a site loads (site_agent/algorithms): no module names the other side by string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from shared.algorithms.exchange import Exchange
from shared.algorithms.server import ServerAggregator
from shared.terms.model_config import ModelConfig

__all__ = ["Algorithm"]


def _weighted_average(_params: BaseModel, _n_sites: int) -> ServerAggregator:
    return ServerAggregator()


def _same_model(config: ModelConfig) -> ModelConfig:
    return config


@dataclass(frozen=True)
class Algorithm:
    """A client algorithm as both sides see it: its parameters, what it exchanges, the server's update, its model."""

    params: type[BaseModel]
    exchange: Callable[[ModelConfig, BaseModel], Exchange]  # from the model's partition to the study's
    server: Callable[[BaseModel, int], ServerAggregator] = _weighted_average  # (params, enrolled sites)
    model: Callable[[ModelConfig], ModelConfig] = _same_model  # the model its sites train, from the study's
