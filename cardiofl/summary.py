"""Parameter counts and sizes of a model config, split into theta^g and phi_k."""

from __future__ import annotations

from dataclasses import dataclass

from shared.model.network import ModelConfig
from shared.model.partition import meta_model, model_partition, model_schema
from shared.tensors.codec import TensorSpec

__all__ = ["PartCounts", "SizeSummary", "module_rows", "summarize"]

MB = 1_000_000  # sizes are reported in decimal megabytes


@dataclass(frozen=True)
class PartCounts:
    """Counts for one side of the partition."""

    tensors: int  # state_dict entries
    parameters: int  # trainable elements
    buffer_elements: int  # BatchNorm running statistics and counters
    nbytes: int  # bytes on the wire / at rest as stored

    @property
    def megabytes(self) -> float:
        """Size in decimal megabytes."""
        return self.nbytes / MB


@dataclass(frozen=True)
class SizeSummary:
    """theta^g and phi_k counts of one config."""

    heads: str
    shared: PartCounts
    local: PartCounts


def _counts(specs: dict[str, TensorSpec], names: tuple[str, ...], buffers: set[str]) -> PartCounts:
    params = sum(specs[n].numel for n in names if n not in buffers)
    buf = sum(specs[n].numel for n in names if n in buffers)
    return PartCounts(len(names), params, buf, sum(specs[n].nbytes for n in names))


def _buffer_names(config: ModelConfig) -> set[str]:
    model = meta_model(config)
    return {name for name, _ in model.named_buffers() if name in model.state_dict()}


def summarize(config: ModelConfig) -> SizeSummary:
    """Counts of theta^g and phi_k for `config` (nothing is allocated)."""
    specs = model_schema(config)
    partition = model_partition(config)
    buffers = _buffer_names(config)
    return SizeSummary(
        config.heads, _counts(specs, partition.shared, buffers), _counts(specs, partition.local, buffers)
    )


def module_rows(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(module group, shared elements, local elements) for each readable part of the model."""
    specs = model_schema(config)
    partition = model_partition(config)
    rows: dict[str, list[int]] = {}
    for name, spec in specs.items():
        parts = name.split(".")
        depth = 2 if parts[0] == "backbone" else 3 if parts[0] == "blocks" else 1
        group = ".".join(parts[:depth]) if len(parts) > depth else ".".join(parts[:-1])
        row = rows.setdefault(group, [0, 0])
        row[1 if partition.is_local(name) else 0] += spec.numel
    return [(group, shared, local) for group, (shared, local) in rows.items()]
