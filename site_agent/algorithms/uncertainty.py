"""H_k for uncertainty-aware aggregation (DataTools4Heart, papers/003): MC-dropout entropy at the site.

p = mean over T stochastic forward passes of sigmoid(logits) (dropout on, BatchNorm in eval mode);
H_k = mean over records and classes of the binary entropy -p ln p - (1 - p) ln(1 - p), in nats.
Only this one number leaves the site (metric `entropy`); the coordinator's `uncertainty`
weighting reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import BaseModel
from torch import nn

from shared.algorithms.params import UncertaintyParams
from shared.algorithms.weightings import ENTROPY_METRIC
from site_agent.data import SiteData, SplitArrays, iterate_batches
from site_agent.device import Runtime

__all__ = ["SITE_REPORTS", "SiteReport", "mc_dropout_entropy"]

# (trained model, the weighting's params, the site's data, runtime) -> metrics added to the update
SiteReport = Callable[[nn.Module, BaseModel, SiteData, Runtime], dict[str, float]]


@torch.no_grad()
def mc_dropout_entropy(
    model: nn.Module, split: SplitArrays, runtime: Runtime, *, passes: int, batch_size: int = 64
) -> float:
    """Mean binary entropy (nats) of the MC-dropout mean prediction of `model` over `split`."""
    if len(split) == 0:
        raise ValueError("no records to estimate the uncertainty on")
    model.train()  # dropout (and attention dropout) on
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()  # normalisation uses the learned statistics, as at inference
    total, count = torch.zeros((), dtype=torch.float64, device=runtime.device), 0
    for x, _ in iterate_batches(split, batch_size, shuffle=False):
        x = x.to(runtime.device, non_blocking=True)
        mean = torch.zeros((), device=runtime.device)
        for _ in range(passes):
            with runtime.autocast():
                logits = model(x)
            mean = mean + torch.sigmoid(logits.float())
        p = mean / passes
        entropy = -(torch.special.xlogy(p, p) + torch.special.xlogy(1 - p, 1 - p))
        total += entropy.double().sum()
        count += entropy.numel()
    model.eval()
    return float(total) / count


def _uncertainty(model: nn.Module, params: BaseModel, data: SiteData, runtime: Runtime) -> dict[str, float]:
    assert isinstance(params, UncertaintyParams)
    split = data.test if len(data.test) else data.train  # held-out records when the site has them
    return {ENTROPY_METRIC: mc_dropout_entropy(model, split, runtime, passes=params.mc_passes)}


# Weighting name (shared/algorithms/weightings.py WEIGHTINGS) -> what the site must report for it.
SITE_REPORTS: dict[str, SiteReport] = {
    "uncertainty": _uncertainty,
}
