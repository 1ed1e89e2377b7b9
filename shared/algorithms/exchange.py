"""What a study exchanges and keeps, by name: the model's partition plus each algorithm's extra tensors.

Every algorithm declares, from the model's FedDualAtt partition:
- which model tensors become local (FedBN's BatchNorm layers, FedPer/FedRep's classifier, ...),
- extra tensors of the global model blob (`server_state`, e.g. Scaffold's server control variate),
- extra tensors of every upload (`uploads`, e.g. Scaffold's delta c_k),
- extra private tensors a site keeps between rounds (`site_state`, e.g. Ditto's personal model),

The global evaluation model (docs/researcher/model.md) is theta^g with phi_0 for the local heads (FedDualAtt's
local attention, FedPer/FedRep's classifier). Local BatchNorm state of phi_0 is untrained (mean 0,
variance 1), so where an algorithm keeps BatchNorm at the site, each site evaluates theta^g with
its own trained BatchNorm instead (`own_in_global`, set for every algorithm by `with_site_batchnorm`),
and the pooled result is labelled `GLOBAL_SITE_BN`. The local baseline (`all_local`) shares nothing, so there is
no theta^g: its global evaluation model is each site's own model (every name `own_in_global`), labelled
`OWN_MODELS`, and its pooled metrics are those of the sites' own models pooled over their test records.

Extra names carry the algorithm's prefix (`scaffold.`, `ditto.` ...), so they never collide with
model names (`backbone.`, `blocks.`, `head.`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
from pydantic import BaseModel
from torch import Tensor, nn

from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_names
from shared.algorithms.params import FedAHParams, FedALAParams, FedBNParams, FedPerParams
from shared.errors import AggregationError
from shared.model.partition import Partition, meta_model, model_partition, model_schema
from shared.tensors.codec import TensorSpec
from shared.terms.model_config import ModelConfig

__all__ = [
    "DITTO_PERSONAL",
    "FEDAH_HEAD",
    "FEDAH_WEIGHT",
    "FEDALA_BN",
    "FEDALA_LOCAL",
    "FEDALA_WEIGHT",
    "GLOBAL",
    "GLOBAL_SITE_BN",
    "LEARNED_HEADS_BLOCK_FALLS",
    "LEARNED_HEADS_HEAD_FALLS",
    "LEARNED_HEADS_ROUNDS",
    "LEARNED_HEADS_SETTLED",
    "OWN_MODELS",
    "SCAFFOLD_C",
    "SCAFFOLD_C_K",
    "SCAFFOLD_DELTA_C",
    "Exchange",
    "ModelNames",
    "all_local",
    "batchnorm_local",
    "buffers_local",
    "ditto",
    "fedah",
    "fedala",
    "fedala_higher",
    "fedcvd_bn_named",
    "head_local",
    "learned_heads",
    "model_names",
    "model_partition_as_is",
    "scaffold",
    "with_site_batchnorm",
]

SCAFFOLD_C = "scaffold.c."  # + parameter name: the server control variate c, in every global model blob
SCAFFOLD_DELTA_C = "scaffold.delta_c."  # + parameter name: c_k+ - c_k, in every Scaffold upload
SCAFFOLD_C_K = "scaffold.c_k."  # + parameter name: the site's control variate c_k, kept at the site
DITTO_PERSONAL = "ditto.personal."  # + state name: Ditto's personal model v_k, kept at the site
FEDALA_WEIGHT = "fedala.weight."  # + parameter name: FedALA's element-wise aggregation weights W
FEDALA_LOCAL = "fedala.local."  # + parameter name: the site's own (trained) higher-layer tensors
FEDALA_BN = "fedala.bn."  # + buffer name: the site's own BatchNorm statistics, where ALA starts from (FedCVD)
FEDAH_WEIGHT = "fedah.weight."  # + head parameter name: FedAH's head aggregation weights W
FEDAH_HEAD = "fedah.head."  # + head parameter name: the site's personal head h_l
LEARNED_HEADS_ROUNDS = "learned_heads.rounds"  # the rounds a site has trained its gates, kept at the site
# the comparisons in a row after which a site's gates all sat unchanged at their bound, kept at the site
LEARNED_HEADS_SETTLED = "learned_heads.settled"
# the validation gates' evidence, kept at the site: the sums of the summed comparisons' head and block falls
LEARNED_HEADS_HEAD_FALLS = "learned_heads.head_falls"
LEARNED_HEADS_BLOCK_FALLS = "learned_heads.block_falls"

GLOBAL = "Global"  # theta^g with phi_0 for the local heads
GLOBAL_SITE_BN = "Global (site BatchNorm)"  # ... and each site's own trained BatchNorm where it is local
OWN_MODELS = "Own models (nothing shared)"  # no theta^g (the local baseline): each site's own model


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
    model = meta_model(config)
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
        head=tuple(name for name, _ in model.named_parameters() if name.startswith("head.")),
    )


@dataclass(frozen=True)
class Exchange:
    """Everything a study moves or keeps, by name; built once per (model, algorithm) in shared/study/rules.py."""

    partition: Partition  # the model's state: shared (theta^g, uploaded and averaged) and local (phi_k)
    schema: dict[str, TensorSpec]  # every model state name -> spec, in state_dict order
    server_state: dict[str, TensorSpec] = field(default_factory=dict)  # extra tensors of the global model blob
    uploads: dict[str, TensorSpec] = field(default_factory=dict)  # extra tensors of every upload
    site_state: dict[str, TensorSpec] = field(default_factory=dict)  # extra private tensors a site may keep
    own_in_global: tuple[str, ...] = ()  # local names the global evaluation model takes from the site, not phi_0
    # local names the global evaluation model sets to a constant, by definition: learned_heads' gate
    # logits at -FROZEN_LOGIT, so that the Global model is theta^g's heads alone (every gate global)
    fixed_in_global: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        extras = [*self.server_state, *self.uploads, *self.site_state]
        clashes = set(extras) & set(self.schema)
        if clashes or len(set(extras)) != len(extras):
            raise AggregationError(f"extra tensor names must be new and distinct: {sorted(clashes) or extras}")
        if not set(self.own_in_global) | set(self.fixed_in_global) <= set(self.partition.local):
            raise AggregationError(f"only local tensors can come from the site: {sorted(self.own_in_global)}")

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

    def global_evaluation_state(
        self, received: Mapping[str, Tensor], own: Mapping[str, Tensor], initial_local: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """The global evaluation model: theta^g (`received`), phi_0 for the local heads, the site's own BatchNorm."""
        own_state = {name: own[name] for name in self.own_in_global}
        return {**received, **initial_local, **own_state, **self.fixed_tensors(initial_local)}

    def fixed_tensors(self, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The tensors `fixed_in_global` sets, shaped like those of `local`."""
        return {name: torch.full_like(local[name], value) for name, value in self.fixed_in_global.items()}

    def global_label(self) -> str:
        """How reports name the pooled metrics of the global evaluation model."""
        if not self.partition.shared:
            return OWN_MODELS
        return GLOBAL_SITE_BN if self.own_in_global else GLOBAL

    def shared_parameters(self, config: ModelConfig) -> tuple[str, ...]:
        """The trainable parameters among the shared names, in model.parameters() order."""
        shared = set(self.partition.shared)
        return tuple(name for name in model_names(config).parameters if name in shared)


def with_site_batchnorm(config: ModelConfig, exchange: Exchange) -> Exchange:
    """`exchange` whose global evaluation model takes the site's own BatchNorm state wherever it is local.

    Names the declaration already takes from the site (`all_local`: every one) stay taken.
    """
    own = set(model_names(config).batchnorm) | set(exchange.own_in_global)
    local = tuple(name for name in exchange.partition.local if name in own)
    return replace(exchange, own_in_global=local)


def _base(config: ModelConfig) -> Exchange:
    return Exchange(model_partition(config), model_schema(config))


def _renamed(prefix: str, specs: Mapping[str, TensorSpec], names: tuple[str, ...]) -> dict[str, TensorSpec]:
    return {prefix + name: specs[name] for name in names}


# -- declarations, one per algorithm family (shared/study/rules.py maps names to them) -------------


def model_partition_as_is(config: ModelConfig, _params: BaseModel) -> Exchange:
    """FedAvg, FedProx: FedDualAtt's partition, nothing extra (with it, FedAvg is FedDualAtt)."""
    return _base(config)


def all_local(config: ModelConfig, _params: BaseModel) -> Exchange:
    """The local baseline: every model tensor stays at the site (phi_k is the whole model); nothing is uploaded.

    Its uploads and global model blobs hold no tensor, and its global evaluation model is the site's own.
    """
    base = _base(config)
    partition = base.partition.move_to_local(base.partition.shared)
    return Exchange(partition, base.schema, own_in_global=partition.local)


def learned_heads(config: ModelConfig, _params: BaseModel) -> Exchange:
    """Learned heads: FedDualAtt's partition of the gated model (gates in phi_k); the site counts its rounds."""
    base = _base(config)
    gates = dict.fromkeys(gate_names(config), -FROZEN_LOGIT)  # Global: every head from theta^g
    kept = {name: TensorSpec((1,), torch.int64) for name in (LEARNED_HEADS_ROUNDS, LEARNED_HEADS_SETTLED)}
    kept[LEARNED_HEADS_HEAD_FALLS] = TensorSpec((config.n_blocks, config.n_heads), torch.float64)
    kept[LEARNED_HEADS_BLOCK_FALLS] = TensorSpec((config.n_blocks,), torch.float64)
    return Exchange(base.partition, base.schema, site_state=kept, fixed_in_global=gates)


def fedcvd_bn_named(config: ModelConfig) -> tuple[str, ...]:
    """The state names FedCVD's FedBN keeps local: those containing "BatchNorm" or "bn" (`fedbn.py`)."""
    return tuple(name for name in model_schema(config) if "BatchNorm" in name or "bn" in name)


def batchnorm_local(config: ModelConfig, params: BaseModel) -> Exchange:
    """FedBN: BatchNorm layers (weight, bias, running statistics, step count) stay at the site.

    Which ones is `local_batchnorm`: FedCVD's name filter leaves the downsample's BatchNorm shared.
    """
    assert isinstance(params, FedBNParams)
    base = _base(config)
    batchnorm = model_names(config).batchnorm if params.local_batchnorm == "all" else fedcvd_bn_named(config)
    return Exchange(base.partition.move_to_local(batchnorm), base.schema)


def head_local(config: ModelConfig, params: BaseModel) -> Exchange:
    """FedPer, FedRep: the classifier `head.*` stays at the site, and BatchNorm statistics unless shared."""
    assert isinstance(params, FedPerParams)
    base = buffers_local(config) if params.bn_statistics == "local" else _base(config)
    return Exchange(base.partition.move_to_local(model_names(config).head), base.schema)


def buffers_local(config: ModelConfig) -> Exchange:
    """PFLlib's exchange: parameters only, so BatchNorm running statistics stay at the site."""
    base = _base(config)
    return Exchange(base.partition.move_to_local(model_names(config).buffers), base.schema)


def scaffold(config: ModelConfig, _params: BaseModel) -> Exchange:
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


def ditto(config: ModelConfig, _params: BaseModel) -> Exchange:
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


def fedala(config: ModelConfig, params: BaseModel) -> Exchange:
    """FedALA; W and the own higher tensors kept.

    BatchNorm statistics "averaged" (FedCVD, which averages the whole state_dict): they are uploaded
    and averaged like the rest, and the site also keeps its own, which ALA leaves in place (it copies
    parameters only). "local" (PFLlib, which exchanges parameters only): they stay at the site.
    """
    assert isinstance(params, FedALAParams)
    averaged = params.bn_statistics == "averaged"
    base = _base(config) if averaged else buffers_local(config)
    higher = fedala_higher(config, base.partition, params.layer_idx)
    own_statistics = _renamed(FEDALA_BN, base.schema, model_names(config).buffers) if averaged else {}
    return Exchange(
        base.partition,
        base.schema,
        site_state={
            **_renamed(FEDALA_WEIGHT, base.schema, higher),
            **_renamed(FEDALA_LOCAL, base.schema, higher),
            **own_statistics,
        },
    )


def fedah(config: ModelConfig, params: BaseModel) -> Exchange:
    """FedAH (PFLlib-based code): parameters exchanged, BN statistics local; the head's W and h_l kept."""
    assert isinstance(params, FedAHParams)
    base = buffers_local(config)
    head = model_names(config).head
    return Exchange(
        base.partition,
        base.schema,
        site_state={**_renamed(FEDAH_WEIGHT, base.schema, head), **_renamed(FEDAH_HEAD, base.schema, head)},
    )
