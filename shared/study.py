"""A study's rules in one place: client algorithms, participation policies, and what a study exchanges.

The registries map the names a study config may use to small rule objects. A later algorithm or
policy is one more entry; nothing else branches on names. `algorithm_exchange` is the only place
that derives which tensors a study exchanges and keeps (the model's FedDualAtt partition, then the
algorithm's declaration, shared/algorithms/exchange.py); the coordinator checks uploads and the
site agent checks downloads against what it returns.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel

from shared.algorithms import exchange as declared
from shared.algorithms.exchange import Exchange
from shared.algorithms.params import (
    DittoParams,
    FedAHParams,
    FedALAParams,
    FedProxParams,
    FedRepParams,
    FractionParams,
    NoParams,
    RandomDropoutParams,
    ScaffoldParams,
)
from shared.algorithms.participation import (
    Participation,
    ParticipationRound,
    every_site,
    fast_on_odd,
    fewer_on_odd,
    random_dropout,
)
from shared.algorithms.server import ScaffoldAggregator, ServerAggregator
from shared.model import ModelConfig, build_model
from shared.partition import Partition, TensorSpec, model_schema

if TYPE_CHECKING:
    from shared.protocol import AlgorithmSpec, ModelSpec, StudyConfig
    from shared.tensors import TensorDict

__all__ = [
    "ALGORITHMS",
    "PARTICIPATIONS",
    "Algorithm",
    "NoParams",
    "Participation",
    "ParticipationRound",
    "algorithm_exchange",
    "algorithm_partition",
    "global_schema",
    "initial_state",
    "partition_schema",
    "select_participants",
    "server_aggregator",
    "shared_schema",
    "study_exchange",
    "study_partition",
]


def _weighted_average(_params: BaseModel, _n_sites: int) -> ServerAggregator:
    return ServerAggregator()


@dataclass(frozen=True)
class Algorithm:
    """A client algorithm as both sides see it: its parameters, what it exchanges, the server's update."""

    params: type[BaseModel]
    exchange: Callable[[ModelConfig, BaseModel], Exchange]  # from the model's partition to the study's
    server: Callable[[BaseModel, int], ServerAggregator] = _weighted_average  # (params, enrolled sites)


def _scaffold_server(params: BaseModel, n_sites: int) -> ServerAggregator:
    assert isinstance(params, ScaffoldParams)
    return ScaffoldAggregator(params.server_lr, n_sites)


# site_agent/algorithms CLIENT_ALGORITHMS holds the client side of every name here.
ALGORITHMS: dict[str, Algorithm] = {
    # Plain local SGD; with the dual-attention partition this is FedDualAtt.
    "fedavg": Algorithm(NoParams, declared.model_partition_as_is),
    "fedprox": Algorithm(FedProxParams, declared.model_partition_as_is),
    "scaffold": Algorithm(ScaffoldParams, declared.scaffold, _scaffold_server),
    "ditto": Algorithm(DittoParams, declared.ditto),
    "fedala": Algorithm(FedALAParams, declared.fedala),
    "fedah": Algorithm(FedAHParams, declared.fedah),
    "fedbn": Algorithm(NoParams, declared.batchnorm_local),
    "fedper": Algorithm(NoParams, declared.head_local),
    "fedrep": Algorithm(FedRepParams, declared.head_local),
}


PARTICIPATIONS: dict[str, Participation] = {
    "all": Participation(NoParams, every_site),
    "random": Participation(RandomDropoutParams, random_dropout),
    "fewer_on_odd": Participation(FractionParams, fewer_on_odd),
    "fast_on_odd": Participation(FractionParams, fast_on_odd, uses_round_times=True),
}


def algorithm_exchange(model: ModelSpec, algorithm: AlgorithmSpec) -> Exchange:
    """What a study of `model` under `algorithm` exchanges and keeps, by name."""
    return _exchange(model.config(), algorithm.name, algorithm.parsed_params())


@lru_cache(maxsize=64)
def _exchange(config: ModelConfig, name: str, params: BaseModel) -> Exchange:
    return ALGORITHMS[name].exchange(config, params)


def algorithm_partition(model: ModelSpec, algorithm: AlgorithmSpec) -> Partition:
    """The model's theta^g / phi_k partition after `algorithm` moved its names to local."""
    return algorithm_exchange(model, algorithm).partition


def partition_schema(config: ModelConfig, partition: Partition) -> dict[str, TensorSpec]:
    """Name -> spec of the shared side of `partition`, in state_dict order."""
    schema = model_schema(config)
    return {name: schema[name] for name in partition.shared}


def study_exchange(config: StudyConfig) -> Exchange:
    """What the study's sites and server exchange and keep."""
    return algorithm_exchange(config.model, config.algorithm)


def study_partition(config: StudyConfig) -> Partition:
    """The study's partition of the model's state: what its sites exchange and what they keep."""
    return study_exchange(config).partition


def shared_schema(config: StudyConfig) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor a site uploads: what each upload must hold exactly."""
    return study_exchange(config).upload_schema()


def global_schema(model: ModelSpec, algorithm: AlgorithmSpec) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor of a global model blob theta^g_t (shared model tensors, server state)."""
    return algorithm_exchange(model, algorithm).global_schema()


def initial_state(config: StudyConfig) -> tuple[TensorDict, TensorDict]:
    """Round 0: (theta^g_0 with the initial server state, phi_0) of the seeded model.

    phi_0 is untrained, so safe to publish; server state (Scaffold's c) starts at zero.
    """
    exchange = study_exchange(config)
    model = build_model(config.model.config(), config.seed)
    shared, local = exchange.partition.split(model.state_dict())
    state = {name: torch.zeros(spec.shape, dtype=spec.dtype) for name, spec in exchange.server_state.items()}
    return {**shared, **state}, local


def server_aggregator(config: StudyConfig) -> ServerAggregator:
    """A fresh server update of the study's algorithm, to be fed one round's updates."""
    rule = ALGORITHMS[config.algorithm.name]
    return rule.server(config.algorithm.parsed_params(), len(config.sites))


def select_participants(
    config: StudyConfig,
    round_number: int,
    attempt: int = 1,
    round_seconds: Callable[[], Mapping[str, float]] | None = None,
) -> dict[str, float]:
    """Site -> load factor |all| / |selected| for one round, as the study's participation policy picks.

    The pick is deterministic in (seed, round, attempt), and in the sites' measured round times
    (`round_seconds()`: site -> last round time per unit of load, called only by policies that
    use it), so a restarted coordinator picks the same.
    """
    rule = PARTICIPATIONS[config.participation.name]
    rng = random.Random((config.seed * 1_000_003 + round_number) * 1_009 + attempt)
    times = dict(round_seconds()) if rule.uses_round_times and round_seconds is not None else {}
    round_ = ParticipationRound(tuple(config.sites), round_number, config.min_sites, rng, times)
    chosen = list(dict.fromkeys(rule.select(round_, config.participation.parsed_params())))
    unknown = set(chosen) - set(config.sites)
    if unknown:
        raise ValueError(f"participation {config.participation.name!r} picked sites outside the study: {unknown}")
    if len(chosen) < config.min_sites:
        raise ValueError(f"participation {config.participation.name!r} picked {len(chosen)} < min_sites sites")
    load_factor = len(config.sites) / len(chosen)
    return dict.fromkeys(chosen, load_factor)
