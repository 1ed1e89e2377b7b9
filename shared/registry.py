"""The names a study config may use: client algorithms and participation policies, each a small rule object.

A later algorithm or policy is one more entry; nothing else branches on names. The protocol's
config models validate names against these registries, and shared/study.py applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from pydantic import BaseModel

from shared.algorithms import exchange as declared
from shared.algorithms.exchange import Exchange
from shared.algorithms.params import (
    DittoParams,
    FedAHParams,
    FedALAParams,
    FedBNParams,
    FedPerParams,
    FedProxParams,
    FedRepParams,
    LearnedHeadsParams,
    NoParams,
    ScaffoldParams,
)
from shared.algorithms.participation import PARTICIPATIONS
from shared.algorithms.server import ScaffoldAggregator, ServerAggregator
from shared.model_config import ModelConfig

__all__ = ["ALGORITHMS", "PARTICIPATIONS", "Algorithm", "exchange_of", "model_of"]


def _weighted_average(_params: BaseModel, _n_sites: int) -> ServerAggregator:
    return ServerAggregator()


def _same_model(config: ModelConfig) -> ModelConfig:
    return config


def _gated_model(config: ModelConfig) -> ModelConfig:
    return replace(config, learned_heads=True)


@dataclass(frozen=True)
class Algorithm:
    """A client algorithm as both sides see it: its parameters, what it exchanges, the server's update."""

    params: type[BaseModel]
    exchange: Callable[[ModelConfig, BaseModel], Exchange]  # from the model's partition to the study's
    server: Callable[[BaseModel, int], ServerAggregator] = _weighted_average  # (params, enrolled sites)
    model: Callable[[ModelConfig], ModelConfig] = _same_model  # the model its sites train, from the study's


def _scaffold_server(params: BaseModel, n_sites: int) -> ServerAggregator:
    assert isinstance(params, ScaffoldParams)
    return ScaffoldAggregator(params.server_lr, n_sites)


# site_agent/algorithms CLIENT_ALGORITHMS holds the client side of every name here.
ALGORITHMS: dict[str, Algorithm] = {
    # Plain local SGD; with the dual-attention partition this is FedDualAtt.
    "fedavg": Algorithm(NoParams, declared.model_partition_as_is),
    "fedprox": Algorithm(FedProxParams, declared.model_partition_as_is),
    "scaffold": Algorithm(ScaffoldParams, declared.scaffold, _scaffold_server),
    # FedCVD's Scaffold as shipped: the same exchange and server, no client correction (unweighted FedAvg).
    "scaffold_fedcvd": Algorithm(ScaffoldParams, declared.scaffold, _scaffold_server),
    "ditto": Algorithm(DittoParams, declared.ditto),
    "fedala": Algorithm(FedALAParams, declared.fedala),
    "fedah": Algorithm(FedAHParams, declared.fedah),
    "fedbn": Algorithm(FedBNParams, declared.batchnorm_local),
    "fedper": Algorithm(FedPerParams, declared.head_local),
    "fedrep": Algorithm(FedRepParams, declared.head_local),
    # Each head's global and local versions mixed by a learned per-site gate (issue #19; learned_heads.py).
    "learned_heads": Algorithm(LearnedHeadsParams, declared.learned_heads, model=_gated_model),
}


@lru_cache(maxsize=64)
def exchange_of(config: ModelConfig, name: str, params: BaseModel) -> Exchange:
    """What a study of the model `config` under algorithm `name` with `params` exchanges and keeps."""
    config = model_of(config, name)
    return declared.with_site_batchnorm(config, ALGORITHMS[name].exchange(config, params))


def model_of(config: ModelConfig, name: str) -> ModelConfig:
    """The model the sites of a study of `config` under algorithm `name` train (learned_heads: the gated one)."""
    return ALGORITHMS[name].model(config)
