"""CompactCNN1D: a per-lead input adapter each site keeps, stride-2 convolution stages, a classifier.

Dimensions: B batch, C leads, L samples, W a stage's channels. The adapter is a 1x1 convolution per
lead (a gain and an offset for each of the C leads), started at the identity: each hospital's
recorders differ in amplitude calibration and baseline, so with `local_adapter` (the default) it is
phi_k and never leaves the site; everything after it is theta^g. The classifier is named `head`,
as cardiofl's personalised algorithms (FedPer, FedRep, FedAH, FedALA) expect.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from shared.model.architecture import Architecture
from shared.terms.model_config import ModelConfig

__all__ = ["COMPACT_CNN_1D", "CompactCNN1D"]


def _stage(c_in: int, c_out: int, kernel: int, depth: int) -> nn.Sequential:
    """`depth` conv-BN-ReLU layers, the first of stride 2."""
    layers: list[nn.Module] = []
    for index in range(depth):
        stride = 2 if index == 0 else 1
        layers += [
            nn.Conv1d(c_in if index == 0 else c_out, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
            nn.BatchNorm1d(c_out),
            nn.ReLU(inplace=True),
        ]
    return nn.Sequential(*layers)


class CompactCNN1D(nn.Module):
    """adapter -> stages -> mean pool over time -> dropout -> head: logits (B, n_classes) of ECGs (B, C, L) in mV."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.adapter = nn.Conv1d(config.n_leads, config.n_leads, 1, groups=config.n_leads)
        with torch.no_grad():  # the identity: a site starts from the signal as recorded
            self.adapter.weight.fill_(1.0)
            self.adapter.bias.zero_()
        stages, c_in = [], config.n_leads
        for index, (width, depth) in enumerate(zip(config.widths, config.depths, strict=True)):
            kernel = config.stem_kernel if index == 0 else config.block_kernel
            stages.append(_stage(c_in, width, kernel, depth))
            c_in = width
        self.stages = nn.Sequential(*stages)
        self.dropout = nn.Dropout(config.dropout)
        self.head = nn.Linear(c_in, config.n_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, n_classes) of raw-millivolt ECGs (B, C, L)."""
        features = self.stages(self.adapter(x)).mean(dim=2)  # (B, W)
        return self.head(self.dropout(features))  # (B, n_classes)


def adapter_local(config: ModelConfig, names: tuple[str, ...]) -> Iterable[str]:
    """phi_k: the input adapter when `local_adapter` is set; else nothing stays at the site."""
    return [name for name in names if name.startswith("adapter.")] if config.option("local_adapter", True) else []


COMPACT_CNN_1D = Architecture(CompactCNN1D, adapter_local)
