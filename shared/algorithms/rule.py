"""A client algorithm as both sides see it: the rule object an entry point of `cardiofl.algorithms` names."""

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
    """A client algorithm as both sides see it: its parameters, what it exchanges, the server's update, its client.

    `client` is the "module:attribute" of its site_agent.algorithms.base.ClientAlgorithm, which only
    a site imports (the coordinator never needs the client side).
    """

    params: type[BaseModel]
    exchange: Callable[[ModelConfig, BaseModel], Exchange]  # from the model's partition to the study's
    server: Callable[[BaseModel, int], ServerAggregator] = _weighted_average  # (params, enrolled sites)
    model: Callable[[ModelConfig], ModelConfig] = _same_model  # the model its sites train, from the study's
    client: str = ""
