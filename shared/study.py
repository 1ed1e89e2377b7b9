"""A study's rules in one place: client algorithms, participation policies, and the shared schema they imply.

The registries map the names a study config may use to small rule objects. A later algorithm or
policy is one more entry; nothing else branches on names. `study_partition` is the only place
that derives which tensors a study exchanges.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from shared.model import build_model
from shared.partition import Partition, TensorSpec, model_partition, model_schema

if TYPE_CHECKING:
    from shared.model import ModelConfig
    from shared.protocol import AlgorithmSpec, ModelSpec, StudyConfig
    from shared.tensors import TensorDict

__all__ = [
    "ALGORITHMS",
    "PARTICIPATIONS",
    "Algorithm",
    "NoParams",
    "Participation",
    "ParticipationRound",
    "algorithm_partition",
    "initial_state",
    "partition_schema",
    "select_participants",
    "shared_schema",
    "study_partition",
]


class NoParams(BaseModel):
    """Parameters of a rule that takes none: any key is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Algorithm:
    """A client algorithm as the coordinator sees it: its parameters and which tensors it keeps local."""

    params: type[BaseModel]
    keep_local: Callable[[Partition, BaseModel], Partition]  # the model's partition -> the study's


def _model_partition_as_is(partition: Partition, _params: BaseModel) -> Partition:
    return partition


ALGORITHMS: dict[str, Algorithm] = {
    # Plain local SGD; with the dual-attention partition this is FedDualAtt.
    "fedavg": Algorithm(NoParams, _model_partition_as_is),
}


@dataclass(frozen=True)
class ParticipationRound:
    """What a participation policy may look at when it picks the sites of one round."""

    sites: tuple[str, ...]  # every enrolled site of the study, in config order
    round_number: int
    min_sites: int
    rng: random.Random  # seeded from (study seed, round, attempt): the same pick after a restart


@dataclass(frozen=True)
class Participation:
    """A participation policy: its parameters and the pick of sites for a round."""

    params: type[BaseModel]
    select: Callable[[ParticipationRound, BaseModel], Sequence[str]]


def _every_site(round_: ParticipationRound, _params: BaseModel) -> Sequence[str]:
    return round_.sites


PARTICIPATIONS: dict[str, Participation] = {
    "all": Participation(NoParams, _every_site),
}


def algorithm_partition(model: ModelSpec, algorithm: AlgorithmSpec) -> Partition:
    """The model's theta^g / phi_k partition after `algorithm` moved its names to local."""
    rule = ALGORITHMS[algorithm.name]
    return rule.keep_local(model_partition(model.config()), algorithm.parsed_params())


def partition_schema(config: ModelConfig, partition: Partition) -> dict[str, TensorSpec]:
    """Name -> spec of the shared side of `partition`, in state_dict order."""
    schema = model_schema(config)
    return {name: schema[name] for name in partition.shared}


def study_partition(config: StudyConfig) -> Partition:
    """The study's partition: what its sites exchange and what they keep."""
    return algorithm_partition(config.model, config.algorithm)


def shared_schema(config: StudyConfig) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor the study exchanges: what each upload must hold exactly."""
    return partition_schema(config.model.config(), study_partition(config))


def initial_state(config: StudyConfig) -> tuple[TensorDict, TensorDict]:
    """Round 0: the seeded model split into (theta^g_0, phi_0); phi_0 is untrained, so safe to publish."""
    model = build_model(config.model.config(), config.seed)
    return study_partition(config).split(model.state_dict())


def select_participants(config: StudyConfig, round_number: int, attempt: int = 1) -> dict[str, float]:
    """Site -> load factor |all| / |selected| for one round, as the study's participation policy picks.

    The pick is deterministic in (seed, round, attempt), so a restarted coordinator picks the same.
    """
    rule = PARTICIPATIONS[config.participation.name]
    rng = random.Random((config.seed * 1_000_003 + round_number) * 1_009 + attempt)
    round_ = ParticipationRound(tuple(config.sites), round_number, config.min_sites, rng)
    chosen = list(dict.fromkeys(rule.select(round_, config.participation.parsed_params())))
    unknown = set(chosen) - set(config.sites)
    if unknown:
        raise ValueError(f"participation {config.participation.name!r} picked sites outside the study: {unknown}")
    if len(chosen) < config.min_sites:
        raise ValueError(f"participation {config.participation.name!r} picked {len(chosen)} < min_sites sites")
    load_factor = len(config.sites) / len(chosen)
    return dict.fromkeys(chosen, load_factor)
