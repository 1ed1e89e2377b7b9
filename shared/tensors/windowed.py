"""Tensors by name whose flat values can be read a window at a time (a stored model, without reading it whole)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping

from torch import Tensor

__all__ = ["WindowedTensors", "flat_window"]


class WindowedTensors(Mapping[str, Tensor]):
    """A Mapping of tensors that also reads flat elements [start, stop) of one tensor alone."""

    @abstractmethod
    def window(self, name: str, start: int, stop: int) -> Tensor:
        """Flat elements [start, stop) of tensor `name` (fewer at its end), a 1-D tensor that owns them."""


def flat_window(tensors: Mapping[str, Tensor], name: str, start: int, stop: int) -> Tensor:
    """Flat elements [start, stop) of `tensors[name]`: read alone where `tensors` can, else sliced from it."""
    if isinstance(tensors, WindowedTensors):
        return tensors.window(name, start, stop)
    return tensors[name].reshape(-1)[start:stop]
