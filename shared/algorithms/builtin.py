"""cardiofl's own algorithms, each a rule that pyproject.toml registers in the `cardiofl.algorithms` entry points.

They reach shared/algorithms/registry.py ALGORITHMS the way a plug-in's do (shared/plugins.py): this module is
imported only through those entry points. Each names its client side (site_agent/algorithms/
builtin.py) by "module:attribute", which only a site resolves.
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

_CLIENTS = "site_agent.algorithms.builtin"


def _scaffold_server(params: BaseModel, n_sites: int) -> ServerAggregator:
    assert isinstance(params, ScaffoldParams)
    return ScaffoldAggregator(params.server_lr, n_sites)


def _gated_model(config: ModelConfig) -> ModelConfig:
    return replace(config, learned_heads=True)


# Plain local SGD; with the dual-attention partition this is FedDualAtt.
FEDAVG = Algorithm(NoParams, declared.model_partition_as_is, client=f"{_CLIENTS}:FEDAVG")
FEDPROX = Algorithm(FedProxParams, declared.model_partition_as_is, client=f"{_CLIENTS}:FEDPROX")
SCAFFOLD = Algorithm(ScaffoldParams, declared.scaffold, _scaffold_server, client=f"{_CLIENTS}:SCAFFOLD")
# FedCVD's Scaffold as shipped: the same exchange and server, no client correction (unweighted FedAvg).
SCAFFOLD_FEDCVD = Algorithm(ScaffoldParams, declared.scaffold, _scaffold_server, client=f"{_CLIENTS}:SCAFFOLD_FEDCVD")
DITTO = Algorithm(DittoParams, declared.ditto, client=f"{_CLIENTS}:DITTO")
FEDALA = Algorithm(FedALAParams, declared.fedala, client=f"{_CLIENTS}:FEDALA")
FEDAH = Algorithm(FedAHParams, declared.fedah, client=f"{_CLIENTS}:FEDAH")
FEDBN = Algorithm(FedBNParams, declared.batchnorm_local, client=f"{_CLIENTS}:FEDBN")
FEDPER = Algorithm(FedPerParams, declared.head_local, client=f"{_CLIENTS}:FEDPER")
FEDREP = Algorithm(FedRepParams, declared.head_local, client=f"{_CLIENTS}:FEDREP")
# Each head's global and local versions mixed by a learned per-site gate (issue #19; learned_heads.py).
LEARNED_HEADS = Algorithm(
    LearnedHeadsParams, declared.learned_heads, model=_gated_model, client=f"{_CLIENTS}:LEARNED_HEADS"
)
