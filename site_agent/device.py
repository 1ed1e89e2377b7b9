"""Where a site trains: CUDA when present (bf16 autocast where supported), CPU otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["Runtime", "resolve_runtime"]


@dataclass(frozen=True)
class Runtime:
    """A torch device and the autocast dtype used on it (None: full fp32), and how much slower to train than it can."""

    device: torch.device
    autocast_dtype: torch.dtype | None
    slowdown: float = 1.0  # > 1: each local round's training takes this many times its time (a slow site, on purpose)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Mixed precision for forward passes where it is safe, a no-op elsewhere."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            yield

    def describe(self) -> str:
        """One line for logs: device name and precision."""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        precision = "fp32" if self.autocast_dtype is None else f"{self.autocast_dtype} autocast"
        return f"{self.device} ({name}, {precision})"


def resolve_runtime(setting: str = "auto", *, mixed_precision: bool = True, slowdown: float = 1.0) -> Runtime:
    """Turn 'auto', 'cpu', 'cuda' or 'cuda:N' into a Runtime; 'auto' picks CUDA when available."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {setting!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {setting!r} requested but CUDA is not available on this machine")
        # bf16 keeps fp32's range, so no loss scaling is needed; older GPUs train in fp32
        dtype = torch.bfloat16 if mixed_precision and torch.cuda.is_bf16_supported() else None
        return Runtime(device, dtype, slowdown)
    if device.type != "cpu":
        raise ValueError(f"unsupported device type {device.type!r}; use cpu or cuda")
    return Runtime(device, None, slowdown)
