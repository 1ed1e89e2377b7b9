"""Name-keyed tensors as one flat float vector, in a fixed order (sorted names), and back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from shared.errors import PrivacyInputError

__all__ = ["TensorLayout", "flatten", "unflatten"]


@dataclass(frozen=True)
class TensorLayout:
    """Where each named tensor lies in a flat vector: names (sorted), shapes and dtypes."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, Tensor]) -> TensorLayout:
        """The layout of `tensors`, names in sorted order so every site derives the same one."""
        names = tuple(sorted(tensors))
        return cls(names, tuple(tuple(tensors[n].shape) for n in names), tuple(tensors[n].dtype for n in names))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of elements of each tensor, in layout order."""
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def length(self) -> int:
        """Number of elements of the flat vector."""
        return sum(self.sizes)


def flatten(tensors: Mapping[str, Tensor], dtype: np.dtype | type = np.float64) -> tuple[np.ndarray, TensorLayout]:
    """Concatenate `tensors` in sorted-name order into one 1-D array of `dtype`, with the layout to undo it."""
    layout = TensorLayout.of(tensors)
    out = np.empty(layout.length, dtype=dtype)
    start = 0
    for name, size in zip(layout.names, layout.sizes, strict=True):
        out[start : start + size] = tensors[name].detach().cpu().reshape(-1).double().numpy()
        start += size
    return out, layout


def unflatten(vector: np.ndarray, layout: TensorLayout) -> dict[str, Tensor]:
    """Split a flat vector back into named tensors of the layout's shapes and dtypes."""
    if vector.shape != (layout.length,):
        raise PrivacyInputError(f"vector of shape {vector.shape} does not fit a layout of {layout.length} elements")
    tensors: dict[str, Tensor] = {}
    start = 0
    for name, shape, dtype, size in zip(layout.names, layout.shapes, layout.dtypes, layout.sizes, strict=True):
        piece = torch.from_numpy(np.ascontiguousarray(vector[start : start + size]))
        tensors[name] = piece.reshape(shape).to(dtype, copy=True)  # never a view of `vector`
        start += size
    return tensors
