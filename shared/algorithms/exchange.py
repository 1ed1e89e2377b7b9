"""What a study exchanges and keeps, by name: the model's partition plus each algorithm's extra tensors.

Every algorithm declares, from the model's FedDualAtt partition:
- which model tensors become local (FedBN's BatchNorm layers, FedPer/FedRep's classifier, ...),
- extra tensors of the global model blob (`server_state`, e.g. Scaffold's server control variate),
- extra tensors of every upload (`uploads`, e.g. Scaffold's delta c_k),
- extra private tensors a site keeps between rounds (`site_state`, e.g. Ditto's personal model).

Extra names carry the algorithm's prefix (`scaffold.`, `ditto.` ...), so they never collide with
model names (`backbone.`, `blocks.`, `head.`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from shared.algorithms.params import FedAHParams, FedALAParams, Params
from shared.model import DualAttentionResNet1D, ModelConfig
from shared.partition import Partition, TensorSpec, model_partition, model_schema

__all__ = [
    "DITTO_PERSONAL",
    "FEDAH_HEAD",
    "FEDAH_WEIGHT",
    "FEDALA_LOCAL",
    "FEDALA_WEIGHT",
    "SCAFFOLD_C",
    "SCAFFOLD_C_K",
    "SCAFFOLD_DELTA_C",
    "Exchange",
    "ModelNames",
    "batchnorm_local",
    "buffers_local",
    "ditto",
    "fedah",
    "fedala",
    "fedala_higher",
    "head_local",
    "model_names",
    "model_partition_as_is",
    "scaffold",
]

SCAFFOLD_C = "scaffold.c."  # + parameter name: the server control variate c, in every global model blob
SCAFFOLD_DELTA_C = "scaffold.delta_c."  # + parameter name: c_k+ - c_k, in every Scaffold upload
SCAFFOLD_C_K = "scaffold.c_k."  # + parameter name: the site's control variate c_k, kept at the site
DITTO_PERSONAL = "ditto.personal."  # + state name: Ditto's personal model v_k, kept at the site
FEDALA_WEIGHT = "fedala.weight."  # + parameter name: FedALA's element-wise aggregation weights W
FEDALA_LOCAL = "fedala.local."  # + parameter name: the site's own (trained) higher-layer tensors
FEDAH_WEIGHT = "fedah.weight."  # + head parameter name: FedAH's head aggregation weights W
FEDAH_HEAD = "fedah.head."  # + head parameter name: the site's personal head h_l


@dataclass(frozen=True)
class ModelNames:
    """Structural name groups of a model's state_dict, in model order."""

    parameters: tuple[str, ...]  # model.parameters() order: the head is last, head.bias the very last
    buffers: tuple[str, ...]  # persistent buffers: BatchNorm running statistics and step counts
    batchnorm: tuple[str, ...]  # every state entry of every BatchNorm layer (affine and statistics)
    head: tuple[str, ...]  # the classifier's parameters (`head.weight`, `head.bias`)


@lru_cache(maxsize=32)
def model_names(config: ModelConfig) -> ModelNames:
    """The name groups of `config`'s model, read from a weightless (meta) instance."""
    with torch.device("meta"):
        model = DualAttentionResNet1D(config)
    batchnorm = tuple(
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for name in module.state_dict()
    )
    return ModelNames(
        parameters=tuple(name for name, _ in model.named_parameters()),
        buffers=tuple(name for name in model.state_dict() if name not in dict(model.named_parameters())),
        batchnorm=batchnorm,
        head=tuple(f"head.{name}" for name, _ in model.head.named_parameters()),
    )


@dataclass(frozen=True)
class Exchange:
    """Everything a study moves or keeps, by name; built once per (model, algorithm) in shared/study.py."""

    partition: Partition  # the model's state: shared (theta^g, uploaded and averaged) and local (phi_k)
    schema: dict[str, TensorSpec]  # every model state name -> spec, in state_dict order
    server_state: dict[str, TensorSpec] = field(default_factory=dict)  # extra tensors of the global model blob
    uploads: dict[str, TensorSpec] = field(default_factory=dict)  # extra tensors of every upload
    site_state: dict[str, TensorSpec] = field(default_factory=dict)  # extra private tensors a site may keep

    def __post_init__(self) -> None:
        extras = [*self.server_state, *self.uploads, *self.site_state]
        clashes = set(extras) & set(self.schema)
        if clashes or len(set(extras)) != len(extras):
            raise ValueError(f"extra tensor names must be new and distinct: {sorted(clashes) or extras}")

    def model_specs(self, names: tuple[str, ...]) -> dict[str, TensorSpec]:
        """Name -> spec of the model tensors `names`."""
        return {name: self.schema[name] for name in names}

    def global_schema(self) -> dict[str, TensorSpec]:
        """What every global model blob theta^g_t holds: the shared model tensors and the server state."""
        return {**self.model_specs(self.partition.shared), **self.server_state}

    def upload_schema(self) -> dict[str, TensorSpec]:
        """What every upload holds exactly: the shared model tensors and the algorithm's extra uploads."""
        return {**self.model_specs(self.partition.shared), **self.uploads}

    def local_names(self) -> frozenset[str]:
        """Every name that stays at the site: phi_k and the algorithm's private state."""
        return frozenset(self.partition.local) | frozenset(self.site_state)

    def shared_parameters(self, config: ModelConfig) -> tuple[str, ...]:
        """The trainable parameters among the shared names, in model.parameters() order."""
        shared = set(self.partition.shared)
        return tuple(name for name in model_names(config).parameters if name in shared)


def _base(config: ModelConfig) -> Exchange:
    return Exchange(model_partition(config), model_schema(config))


def _renamed(prefix: str, specs: Mapping[str, TensorSpec], names: tuple[str, ...]) -> dict[str, TensorSpec]:
    return {prefix + name: specs[name] for name in names}


# -- declarations, one per algorithm family (shared/study.py maps names to them) -------------


def model_partition_as_is(config: ModelConfig, _params: Params) -> Exchange:
    """FedAvg, FedProx: FedDualAtt's partition, nothing extra (with it, FedAvg is FedDualAtt)."""
    return _base(config)


def batchnorm_local(config: ModelConfig, _params: Params) -> Exchange:
    """FedBN: every BatchNorm layer (weight, bias, running statistics, step count) stays at the site."""
    base = _base(config)
    return Exchange(base.partition.move_to_local(model_names(config).batchnorm), base.schema)


def head_local(config: ModelConfig, _params: Params) -> Exchange:
    """FedPer, FedRep: the classifier `head.*` stays at the site; the body is shared."""
    base = _base(config)
    return Exchange(base.partition.move_to_local(model_names(config).head), base.schema)


def buffers_local(config: ModelConfig) -> Exchange:
    """PFLlib's exchange: parameters only, so BatchNorm running statistics stay at the site."""
    base = _base(config)
    return Exchange(base.partition.move_to_local(model_names(config).buffers), base.schema)


def scaffold(config: ModelConfig, _params: Params) -> Exchange:
    """Scaffold: c per shared parameter in the global blob; sites upload delta c_k and keep c_k."""
    base = _base(config)
    names = base.shared_parameters(config)
    return Exchange(
        base.partition,
        base.schema,
        server_state=_renamed(SCAFFOLD_C, base.schema, names),
        uploads=_renamed(SCAFFOLD_DELTA_C, base.schema, names),
        site_state=_renamed(SCAFFOLD_C_K, base.schema, names),
    )


def ditto(config: ModelConfig, _params: Params) -> Exchange:
    """Ditto: the uploaded model is trained as in FedAvg; the personal model v_k (whole state) stays."""
    base = _base(config)
    return Exchange(base.partition, base.schema, site_state=_renamed(DITTO_PERSONAL, base.schema, tuple(base.schema)))


def fedala_higher(config: ModelConfig, partition: Partition, layer_idx: int) -> tuple[str, ...]:
    """FedALA's higher layers: the last `layer_idx` tensors of model.parameters() that are shared.

    As PFLlib's `params[-layer_idx:]`: 1 is `head.bias`, 2 adds `head.weight`; a count beyond the
    number of parameters takes them all. Local (phi_k) tensors among them have no global
    counterpart to mix with and are skipped.
    """
    trailing = model_names(config).parameters[-layer_idx:]
    return tuple(name for name in trailing if not partition.is_local(name))


def fedala(config: ModelConfig, params: Params) -> Exchange:
    """FedALA (PFLlib): parameters exchanged, BN statistics local; W and the own higher tensors kept."""
    assert isinstance(params, FedALAParams)
    base = buffers_local(config)
    higher = fedala_higher(config, base.partition, params.layer_idx)
    return Exchange(
        base.partition,
        base.schema,
        site_state={
            **_renamed(FEDALA_WEIGHT, base.schema, higher),
            **_renamed(FEDALA_LOCAL, base.schema, higher),
        },
    )


def fedah(config: ModelConfig, params: Params) -> Exchange:
    """FedAH (PFLlib-based code): parameters exchanged, BN statistics local; the head's W and h_l kept."""
    assert isinstance(params, FedAHParams)
    base = buffers_local(config)
    head = model_names(config).head
    return Exchange(
        base.partition,
        base.schema,
        site_state={**_renamed(FEDAH_WEIGHT, base.schema, head), **_renamed(FEDAH_HEAD, base.schema, head)},
    )
