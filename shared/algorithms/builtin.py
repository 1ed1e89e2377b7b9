"""cardiofl's own algorithms, each a rule that pyproject.toml registers in the `cardiofl.algorithms` entry points.

They reach shared/algorithms/registry.py ALGORITHMS the way a plug-in's do (shared/plugins.py): this module is
imported only through those entry points. Their client sides are `cardiofl.clients` entry points of the same
names (site_agent/algorithms/builtin.py), registered by the same pyproject.toml, as a plug-in registers both.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel

from shared.algorithms import exchange as declared
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
from shared.algorithms.rule import Algorithm
from shared.algorithms.server import ScaffoldAggregator, ServerAggregator
from shared.terms.model_config import ModelConfig


def _scaffold_server(params: BaseModel, n_sites: int) -> ServerAggregator:
    assert isinstance(params, ScaffoldParams)
    return ScaffoldAggregator(params.server_lr, n_sites)


def _gated_model(config: ModelConfig) -> ModelConfig:
    return replace(config, learned_heads=True)


# Plain local SGD; with the dual-attention partition this is FedDualAtt.
FEDAVG = Algorithm(NoParams, declared.model_partition_as_is)
FEDPROX = Algorithm(FedProxParams, declared.model_partition_as_is)
SCAFFOLD = Algorithm(ScaffoldParams, declared.scaffold, _scaffold_server)
# FedCVD's Scaffold as shipped: the same exchange and server, no client correction (unweighted FedAvg).
SCAFFOLD_FEDCVD = Algorithm(ScaffoldParams, declared.scaffold, _scaffold_server)
DITTO = Algorithm(DittoParams, declared.ditto)
FEDALA = Algorithm(FedALAParams, declared.fedala)
FEDAH = Algorithm(FedAHParams, declared.fedah)
FEDBN = Algorithm(FedBNParams, declared.batchnorm_local)
FEDPER = Algorithm(FedPerParams, declared.head_local)
FEDREP = Algorithm(FedRepParams, declared.head_local)
# The local baseline: each site trains alone, nothing but metrics leaves it (DataTools4Heart Fig. 2).
LOCAL = Algorithm(NoParams, declared.all_local)
# Each head's global and local versions mixed by a learned per-site gate (issue #19; learned_heads.py).
LEARNED_HEADS = Algorithm(LearnedHeadsParams, declared.learned_heads, model=_gated_model)
