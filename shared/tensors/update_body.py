"""An update's body: the site's shared tensors as safetensors, its UpdateMeta as JSON in their header."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from shared.tensors.codec import dump
from shared.wire.protocol import UpdateMeta

__all__ = ["encode_update"]


def encode_update(tensors: Mapping[str, Tensor], meta: UpdateMeta) -> bytes:
    """The body of an update upload: the shared tensors as safetensors, `meta` in their header."""
    return dump(tensors, meta.to_metadata())
