"""A second reading of Global for comparison with the paper: theta^g_T with the sites' phi_k averaged.

The service's Global model is theta^g_T with phi_0 for the local heads (and each site's own
BatchNorm where an algorithm keeps it local), because phi_k never leaves a site. A reader of the
paper may expect instead one model whose local tensors are averaged like the rest, as FedCVD's
server averages the whole state. Only a simulation holds every site's phi_k, so only the runner
reports it: the sites' phi_k averaged with the weights theta^g_T was aggregated with, evaluated on
every site's test split and pooled exactly as Global is.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.aggregation import weighted_average
from shared.metrics import Summary, parse_contribution, pooled_summary
from shared.model import build_model
from shared.protocol import StudyConfig
from shared.study import study_exchange
from shared.tensors import TensorDict
from site_agent.data import SiteData
from site_agent.device import Runtime
from site_agent.local_round import evaluate

__all__ = ["PHI_K_AVERAGED", "averaged_local", "averaged_local_reading", "pooled_reading"]

PHI_K_AVERAGED = "Global (phi_k averaged)"  # the label of this reading in records and reports


def averaged_local(
    private: Mapping[str, TensorDict], weights: Mapping[str, float], names: tuple[str, ...]
) -> TensorDict:
    """The sites' local model tensors `names` averaged with `weights` (site -> w_k), as theta^g is aggregated."""
    return weighted_average(({name: private[site][name] for name in names}, w) for site, w in sorted(weights.items()))


def pooled_reading(study: StudyConfig, state: TensorDict, data: Mapping[str, SiteData], runtime: Runtime) -> Summary:
    """The model holding `state`, evaluated on every site's test split and pooled as Global is."""
    model = build_model(study.model.config(), study.seed)
    model.load_state_dict(state, strict=True)
    model.to(runtime.device)
    contributions = []
    for site in sorted(study.sites):
        if len(data[site].test):
            predictions = evaluate(model, data[site].test, runtime)
            contributions.append(parse_contribution(predictions.contribution(study.privacy)))
    return pooled_summary(contributions)


def averaged_local_reading(
    study: StudyConfig,
    theta: TensorDict,
    private: Mapping[str, TensorDict],
    weights: Mapping[str, float],
    data: Mapping[str, SiteData],
    runtime: Runtime,
) -> Summary:
    """Pooled metrics of theta^g_T with the phi_k of the sites that made it, averaged with its weights."""
    partition = study_exchange(study).partition
    shared = {name: theta[name] for name in partition.shared}
    local = averaged_local(private, weights, partition.local) if partition.local else {}
    return pooled_reading(study, {**shared, **local}, data, runtime)
