"""H_k for uncertainty-aware aggregation (DataTools4Heart, papers/003): MC-dropout entropy at the site.

p = mean over T stochastic forward passes of sigmoid(logits) (dropout on, BatchNorm in eval mode);
H_k = mean over records and classes of the binary entropy -p ln p - (1 - p) ln(1 - p), in nats.
Only this one number leaves the site (metric `entropy`); the coordinator's `uncertainty`
weighting reads it. H_k is measured on a validation share of the training records, carved once per
study and site and never trained on; the test split never steers the aggregation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from pydantic import BaseModel
from torch import nn

from shared.algorithms.params import UncertaintyParams
from shared.algorithms.registry import parsed_params
from shared.algorithms.weightings import ENTROPY_METRIC
from shared.terms import AggregationSpec
from site_agent.algorithms.base import stable_seed
from site_agent.data import SiteData, SplitArrays, iterate_batches
from site_agent.data.loader import carve_validation
from site_agent.device import Runtime

__all__ = ["SITE_REPORTS", "SiteReport", "mc_dropout_entropy", "report_for_weighting", "validation_seed"]

# (trained model, runtime) -> the metrics added to the update
Measure = Callable[[nn.Module, Runtime], dict[str, float]]


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


@dataclass(frozen=True)
class SiteReport:
    """What a site reports for a weighting, measured on validation records carved from its training split."""

    # (trained model, the weighting's params, the validation records, runtime) -> metrics added to the update
    measure: Callable[[nn.Module, BaseModel, SplitArrays, Runtime], dict[str, float]]
    # the weighting's params -> the share of the training records carved out (never trained on)
    validation_fraction: Callable[[BaseModel], float]


def _entropy(model: nn.Module, params: BaseModel, validation: SplitArrays, runtime: Runtime) -> dict[str, float]:
    assert isinstance(params, UncertaintyParams)
    return {ENTROPY_METRIC: mc_dropout_entropy(model, validation, runtime, passes=params.mc_passes)}


def _uncertainty_fraction(params: BaseModel) -> float:
    assert isinstance(params, UncertaintyParams)
    return params.validation_fraction


# Weighting name (shared/algorithms/weightings.py WEIGHTINGS) -> what the site must report for it.
SITE_REPORTS: dict[str, SiteReport] = {
    "uncertainty": SiteReport(_entropy, _uncertainty_fraction),
}


def validation_seed(study_seed: int, site: str) -> int:
    """The seed of a site's validation carve: the same every round of a study."""
    return stable_seed("validation", study_seed, site)


def _nothing(_model: nn.Module, _runtime: Runtime) -> dict[str, float]:
    return {}


def report_for_weighting(
    aggregation: AggregationSpec, data: SiteData, *, study_seed: int, site: str
) -> tuple[SiteData, Measure]:
    """The site's data to train on, and what to add to its update, for the study's aggregation weighting."""
    report = SITE_REPORTS.get(aggregation.name)
    if report is None:  # nothing to report: train on the whole training split, as given
        return data, _nothing
    params = parsed_params(aggregation)
    train, validation = carve_validation(
        data.train, seed=validation_seed(study_seed, site), fraction=report.validation_fraction(params)
    )

    def measure(model: nn.Module, runtime: Runtime) -> dict[str, float]:  # on the carve only, never the test split
        return report.measure(model, params, validation, runtime)

    return replace(data, train=train), measure
