"""A second reading of Global for comparison with the paper: theta^g_T with the sites' phi_k averaged.

The service's Global model is theta^g_T with phi_0 for the local heads (and each site's own
BatchNorm where an algorithm keeps it local), because phi_k never leaves a site. A reader of the
paper may expect instead one model whose local tensors are averaged like the rest, as FedCVD's
server averages the whole state. Only a simulation holds every site's phi_k, so only the runner
reports it: the sites' phi_k averaged with the weights theta^g_T was aggregated with, evaluated on
every site's test split and pooled exactly as Global is.

With per-site head splits (model.site_heads) each local head is averaged over the sites that hold
it as local (weights renormalised per head; a head no site keeps local stays at phi_0), and each
site evaluates the model at its own split, as it evaluates Global.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shared.algorithms.aggregation import weighted_average
from shared.algorithms.head_splits import HeadSplitAverage, site_usage
from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_names
from shared.algorithms.server import next_global
from shared.evaluation.metrics import Summary, parse_contribution
from shared.evaluation.summaries import pooled_summary
from shared.model.network import build_model, load_released
from shared.study.rules import algorithm_model, initial_state, study_exchange
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from site_agent.data import SiteData
from site_agent.device import Runtime
from site_agent.local_round import evaluate

__all__ = ["PHI_K_AVERAGED", "averaged_learned_heads", "averaged_local", "averaged_local_reading", "pooled_reading"]

PHI_K_AVERAGED = "Global (phi_k averaged)"  # the label of this reading in records and reports


def averaged_local(
    private: Mapping[str, TensorDict], weights: Mapping[str, float], names: tuple[str, ...]
) -> TensorDict:
    """The sites' local model tensors `names` averaged with `weights` (site -> w_k), as theta^g is aggregated."""
    return weighted_average(({name: private[site][name] for name in names}, w) for site, w in sorted(weights.items()))


def pooled_reading(study: StudyTerms, state: TensorDict, data: Mapping[str, SiteData], runtime: Runtime) -> Summary:
    """The model holding `state`, evaluated on every site's test split (at its own head split), pooled as Global is."""
    models: dict[str, nn.Module] = {}
    contributions = []
    for site in sorted(study.sites):
        if len(data[site].test):
            split = study.model.split_of(site)
            if split not in models:
                config = algorithm_model(study.model.for_site(site), study.algorithm)
                models[split] = load_released(build_model(config, study.seed), state).to(runtime.device)
            predictions = evaluate(models[split], data[site].test, runtime)
            contributions.append(parse_contribution(predictions.contribution(study.privacy)))
    return pooled_summary(contributions)


def _averaged_local_heads(
    study: StudyTerms, private: Mapping[str, TensorDict], weights: Mapping[str, float], names: tuple[str, ...]
) -> TensorDict:
    """Per-site head splits: each local head averaged over the sites that hold it as local, else phi_0."""
    sites = sorted(weights)
    usages = [1.0 - site_usage(study.model.for_site(site).config()) for site in sites]
    average = HeadSplitAverage(study.model.config(), usages, branch="local")
    _, phi_0 = initial_state(study)
    updates = (({name: private[site][name] for name in names}, weights[site]) for site in sites)
    return next_global(average, {name: phi_0[name] for name in names}, updates)


def averaged_learned_heads(
    study: StudyTerms, private: Mapping[str, TensorDict], weights: Mapping[str, float], names: tuple[str, ...]
) -> TensorDict:
    """Learned heads: local heads averaged with w_k * g_{k,b,h}, and each gate the sites' weighted mean gate."""
    config = algorithm_model(study.model, study.algorithm)
    gates = gate_names(config)
    sites = sorted(weights)
    usages = [torch.stack([torch.sigmoid(private[site][gate].double()) for gate in gates]) for site in sites]
    heads = tuple(name for name in names if name not in gates)
    _, phi_0 = initial_state(study)
    updates = (({name: private[site][name] for name in heads}, weights[site]) for site in sites)
    local = next_global(
        HeadSplitAverage(config, usages, branch="local", bias="mean"), {n: phi_0[n] for n in heads}, updates
    )
    total = sum(weights[site] for site in sites)
    mean = sum(weights[site] * usage for site, usage in zip(sites, usages, strict=True)) / total
    assert isinstance(mean, torch.Tensor)  # a tensor: there is at least one site, or total would be 0
    logits = torch.logit(mean).clamp(-FROZEN_LOGIT, FROZEN_LOGIT).float()  # logit(0) = -inf, logit(1) = inf
    return {**local, **{gate: logits[b] for b, gate in enumerate(gates)}}


def averaged_local_reading(
    study: StudyTerms,
    theta: TensorDict,
    private: Mapping[str, TensorDict],
    weights: Mapping[str, float],
    data: Mapping[str, SiteData],
    runtime: Runtime,
) -> Summary:
    """Pooled metrics of theta^g_T with the phi_k of the sites that made it, averaged with its weights."""
    partition = study_exchange(study).partition
    shared = {name: theta[name] for name in partition.shared}
    if not partition.local:
        local: TensorDict = {}
    elif study.model.site_heads:
        local = _averaged_local_heads(study, private, weights, partition.local)
    elif algorithm_model(study.model, study.algorithm).learned_heads:
        local = averaged_learned_heads(study, private, weights, partition.local)
    else:
        local = averaged_local(private, weights, partition.local)
    return pooled_reading(study, {**shared, **local}, data, runtime)
