"""The global/local split of a model's state: theta^g (shared, averaged) and phi_k (kept at the site)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from shared.errors import AggregationError
from shared.model.architecture import architecture_of
from shared.model.network import HEAD_GATE_PATTERN, LOCAL_BRANCH_PATTERN, ModelConfig
from shared.tensors.codec import TensorSpec

__all__ = [
    "HEAD_GATE_PATTERN",
    "LOCAL_BRANCH_PATTERN",
    "Partition",
    "meta_model",
    "model_partition",
    "model_schema",
]


def meta_model(config: ModelConfig) -> nn.Module:
    """`config`'s network on the meta device: its structure and state names, no weights allocated."""
    with torch.device("meta"):
        return architecture_of(config).build(config)


def model_schema(config: ModelConfig) -> dict[str, TensorSpec]:
    """Name -> spec of every state_dict entry, in state_dict order, without allocating weights."""
    return {name: TensorSpec.of(t) for name, t in meta_model(config).state_dict().items()}


@dataclass(frozen=True)
class Partition:
    """Disjoint shared and local name sets that together cover a model's whole state_dict.

    Algorithms extend it with `move_to_local` (FedBN's BN layers, FedPer's classifier ...); the
    result is again a Partition, so the shared schema is always derived from one value.
    """

    shared: tuple[str, ...]
    local: tuple[str, ...]

    def __post_init__(self) -> None:
        overlap = set(self.shared) & set(self.local)
        if overlap:
            raise AggregationError(f"names both shared and local: {sorted(overlap)}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name, shared first."""
        return self.shared + self.local

    def is_local(self, name: str) -> bool:
        """Whether `name` stays at the site."""
        return name in self._local_set

    @cached_property
    def _local_set(self) -> frozenset[str]:
        return frozenset(self.local)

    def move_to_local(self, names: Iterable[str]) -> Partition:
        """A partition where `names` (which must be shared now, or already local) stay at the site."""
        moving = set(names)
        unknown = moving - set(self.names)
        if unknown:
            raise AggregationError(f"not in the model: {sorted(unknown)}")
        shared = tuple(n for n in self.shared if n not in moving)
        local = self.local + tuple(n for n in self.shared if n in moving)
        return Partition(shared, local)

    def move_matching_to_local(self, pattern: str) -> Partition:
        """Move every shared name matching the regular expression `pattern` to the local side."""
        regex = re.compile(pattern)
        return self.move_to_local(n for n in self.shared if regex.search(n))

    def split(self, state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Split a full state into (shared, local) dicts; the state must have exactly our names."""
        missing = set(self.names) - state.keys()
        extra = state.keys() - set(self.names)
        if missing or extra:
            raise KeyError(f"state does not match the partition: missing {sorted(missing)}, extra {sorted(extra)}")
        return {n: state[n] for n in self.shared}, {n: state[n] for n in self.local}


def model_partition(config: ModelConfig) -> Partition:
    """The partition of `config`'s model by its architecture's rule (FedDualAtt's: the local branches are phi_k)."""
    names = tuple(model_schema(config))
    chosen = set(architecture_of(config).local(config, names))
    unknown = chosen - set(names)
    if unknown:
        raise AggregationError(f"{config.architecture} keeps tensors its model does not have: {sorted(unknown)}")
    local = tuple(n for n in names if n in chosen)
    shared = tuple(n for n in names if n not in chosen)
    return Partition(shared, local)
