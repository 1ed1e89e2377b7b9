"""A study's rules applied to a study config: what it exchanges, its round 0, its server update, its participants.

The names a config may use live in shared/algorithms/registry.py; `algorithm_exchange` is the only place that
derives which tensors a study exchanges and keeps (the model's FedDualAtt partition, then the
algorithm's declaration, shared/algorithms/exchange.py); the coordinator checks uploads and the
site agent checks downloads against what it returns.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from shared.algorithms.exchange import Exchange
from shared.algorithms.head_splits import (
    HEAD_WEIGHTS,
    SECURE_MIN_SLOT_WEIGHT,
    HeadSplitAverage,
    element_factors,
    per_head_names,
    site_usage,
    slot_factors,
)
from shared.algorithms.learned_heads import usage_tensor
from shared.algorithms.participation import PARTICIPATIONS, ParticipationRound
from shared.algorithms.registry import ALGORITHMS, exchange_of, model_of, parsed_params
from shared.algorithms.server import ServerAggregator
from shared.errors import StudyRuleError
from shared.model.network import ModelConfig, build_model
from shared.model.partition import Partition, model_schema
from shared.privacy.masking import RingVector
from shared.study.dp import GRID_BITS, CentralNoiseAverage, add_ring_noise, dp_fraction_bits
from shared.study.round_terms import load_factor
from shared.study.secagg import SecureLayout, site_vector
from shared.tensors.codec import TensorDict, TensorSpec
from shared.terms import AlgorithmSpec, ModelSpec, StudyTerms
from shared.wire.protocol import UpdateMeta
from shared.wire.secure import masked_sections

__all__ = [
    "algorithm_exchange",
    "algorithm_model",
    "algorithm_partition",
    "global_schema",
    "initial_state",
    "partition_schema",
    "masked_update_schema",
    "secure_layout",
    "add_secure_sum_noise",
    "secure_site_vector",
    "participation_problem",
    "select_participants",
    "server_aggregator",
    "shared_schema",
    "study_exchange",
    "study_partition",
]


def algorithm_exchange(model: ModelSpec, algorithm: AlgorithmSpec) -> Exchange:
    """What a study of `model` under `algorithm` exchanges and keeps, by name."""
    return exchange_of(model.config(), algorithm.name, parsed_params(algorithm))


def algorithm_model(model: ModelSpec, algorithm: AlgorithmSpec) -> ModelConfig:
    """The model a site of `model` under `algorithm` trains (learned_heads: with gated full-width branches)."""
    return model_of(model.config(), algorithm.name)


def algorithm_partition(model: ModelSpec, algorithm: AlgorithmSpec) -> Partition:
    """The model's theta^g / phi_k partition after `algorithm` moved its names to local."""
    return algorithm_exchange(model, algorithm).partition


def partition_schema(config: ModelConfig, partition: Partition) -> dict[str, TensorSpec]:
    """Name -> spec of the shared side of `partition`, in state_dict order."""
    schema = model_schema(config)
    return {name: schema[name] for name in partition.shared}


def study_exchange(config: StudyTerms) -> Exchange:
    """What the study's sites and server exchange and keep."""
    return algorithm_exchange(config.model, config.algorithm)


def study_partition(config: StudyTerms) -> Partition:
    """The study's partition of the model's state: what its sites exchange and what they keep."""
    return study_exchange(config).partition


def shared_schema(config: StudyTerms) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor a site uploads: what each upload must hold exactly."""
    return study_exchange(config).upload_schema()


def global_schema(model: ModelSpec, algorithm: AlgorithmSpec) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor of a global model blob theta^g_t (shared model tensors, server state)."""
    return algorithm_exchange(model, algorithm).global_schema()


def initial_state(config: StudyTerms) -> tuple[TensorDict, TensorDict]:
    """Round 0: (theta^g_0 with the initial server state, phi_0) of the seeded model.

    phi_0 is untrained, so safe to publish; server state (Scaffold's c) starts at zero.
    """
    exchange = study_exchange(config)
    model = build_model(algorithm_model(config.model, config.algorithm), config.seed)
    shared, local = exchange.partition.split(model.state_dict())
    state = {name: torch.zeros(spec.shape, dtype=spec.dtype) for name, spec in exchange.server_state.items()}
    return {**shared, **state}, local


def server_aggregator(
    config: StudyTerms, participants: Sequence[str] = (), metas: Sequence[UpdateMeta] = ()
) -> ServerAggregator:
    """A fresh server update of the study's algorithm, to be fed one round's updates.

    `participants` are the sites whose updates will be added, in that order; a study with per-site
    head splits weighs each head by them (shared/algorithms/head_splits.py), its usages derived from
    the study config, never from the uploads. Learned heads weigh each head by the usages uploaded
    with the updates (`metas`: the updates' metas, in the same order; shared/algorithms/learned_heads.py).
    """
    model = algorithm_model(config.model, config.algorithm)
    per_head = _per_head_weighting(config.model, config.algorithm)
    if per_head is not None and config.privacy.secure_aggregation is not None:
        # no usages: it takes the per-head weights summed under the masks (HeadSplitAverage.take_sums)
        return HeadSplitAverage(per_head[0], (), bias=per_head[1], min_slot_weight=SECURE_MIN_SLOT_WEIGHT)
    if model.learned_heads:  # validation allows only the plain average in the clear with them
        if any(meta.head_usage is None for meta in metas):
            raise StudyRuleError("an update of a learned-heads study lacks its head usage")
        usages = [usage_tensor(meta.head_usage) for meta in metas if meta.head_usage is not None]
        return HeadSplitAverage(model, usages, bias="mean")
    if config.model.site_heads:  # validation allows only the plain average with them
        usages = [site_usage(config.model.for_site(site).config()) for site in participants]
        return HeadSplitAverage(config.model.config(), usages)
    dp = config.privacy.dp
    if dp is not None and dp.mode == "central" and config.privacy.secure_aggregation is None:
        return CentralNoiseAverage(dp, GRID_BITS)  # the noised sum of the changes on the grid (shared/privacy)
    rule = ALGORITHMS[config.algorithm.name]
    return rule.server(parsed_params(config.algorithm), len(config.sites))


def _per_head_weighting(model: ModelSpec, algorithm: AlgorithmSpec) -> tuple[ModelConfig, str] | None:
    """(the full-width model, W_out's bias rule) when heads are averaged with per-head weights, else None."""
    config = algorithm_model(model, algorithm)
    if config.learned_heads:
        return config, "mean"
    if model.site_heads:
        return model.config(), "any"
    return None


def secure_layout(
    model: ModelSpec, algorithm: AlgorithmSpec, *, train: bool, fraction_bits: int, ring_bits: int = 64
) -> SecureLayout:
    """A secure round's ring layout: the upload schema (none in the final evaluation), weighted as its server sums.

    With per-head weights (per-site splits, learned heads) it also sums HEAD_WEIGHTS, each site's
    w_k u_{k,b,h}, which the per-head tensors are multiplied by at the site in place of w_k. With
    `ring_bits` 32 the model tensors that theta^g holds and the server averages with w_k are summed in
    Z_{2^32} as their change from theta^g (secagg.SecureLayout); the rest stays in Z_{2^64}.
    """
    exchange = algorithm_exchange(model, algorithm)
    schema = exchange.upload_schema() if train else {}
    per_head = _per_head_weighting(model, algorithm)
    if train and per_head is not None:
        blocks, heads = per_head[0].n_blocks, per_head[0].n_heads
        schema = {**schema, HEAD_WEIGHTS: TensorSpec((blocks, heads + 1), torch.float64)}
    server = ALGORITHMS[algorithm.name].server(parsed_params(algorithm), 1)  # what it weighs is the same for any N
    weighs: Callable[[str], bool] = lambda name: name != HEAD_WEIGHTS and server.weighs(name)  # noqa: E731
    in_theta, per_element = exchange.global_schema(), per_head_names(schema) if per_head is not None else frozenset()

    def narrow(name: str) -> bool:
        spec = schema[name]
        return (
            ring_bits == 32
            and in_theta.get(name) == spec
            and spec.dtype.is_floating_point
            and weighs(name)
            and name not in per_element
        )

    return SecureLayout.of(schema, model.config().n_classes, fraction_bits, weighs=weighs, narrow=narrow)


def masked_update_schema(layout: SecureLayout) -> dict[str, TensorSpec]:
    """What a secure round's update holds: its masked Z_{2^32} section as int32 words (if any), Z_{2^64} as int64."""
    sections = masked_sections(layout.narrow_length, layout.wide_length)
    return {name: TensorSpec((length,), getattr(torch, dtype)) for name, (length, dtype) in sections.items()}


def secure_site_vector(
    layout: SecureLayout,
    model: ModelSpec,
    algorithm: AlgorithmSpec,
    site: str,
    shared: Mapping[str, torch.Tensor],
    weight: float,
    meta: UpdateMeta,
    out: RingVector | None = None,
    base: Mapping[str, torch.Tensor] | None = None,
    grid: Mapping[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A site's unmasked ring vector (secagg.site_vector), its heads weighted by its own usage.

    Where the study weighs heads, the usage is its split's (model.site_heads) or its learned usages
    (meta.head_usage), summed under the masks and never sent in the clear. `base` is theta^g.
    A DP release's change on the grid (`grid`) is summed as it is, with weight 1 in place of w_k:
    DP weighs sites equally, and the server divides the sum by the survivors' count.
    """
    per_head = _per_head_weighting(model, algorithm)
    if grid:
        return site_vector(layout, shared, 1.0, meta.metrics.eval_stats, out=out, base=base, grid=grid)
    if per_head is None or HEAD_WEIGHTS not in layout.schema:
        return site_vector(layout, shared, weight, meta.metrics.eval_stats, out=out, base=base)
    config, bias = per_head
    if config.learned_heads:
        if meta.head_usage is None:
            raise StudyRuleError("a learned-heads site's result lacks its head usage")
        usage = usage_tensor(meta.head_usage)
    else:
        usage = site_usage(model.for_site(site).config())
    factors = slot_factors(usage, weight, bias)
    per_element = element_factors(layout.schema, config, factors)
    tensors = {**shared, HEAD_WEIGHTS: factors}  # summed with factor 1: the layout does not weigh it
    return site_vector(layout, tensors, weight, meta.metrics.eval_stats, out=out, factors=per_element, base=base)


def add_secure_sum_noise(config: StudyTerms, layout: SecureLayout, ring_sum: RingVector) -> None:
    """Central DP of a secure round: N_Z(0, sigma^2) on the unmasked Z_{2^32} sum of the changes, before decoding."""
    dp = config.privacy.dp
    if dp is None or dp.mode != "central" or not layout.narrow_length:
        return
    narrow, _ = layout.sections_of(ring_sum)
    add_ring_noise(narrow, dp, dp_fraction_bits(config))


def _participation_round(
    config: StudyTerms, round_number: int, attempt: int, times: Mapping[str, float]
) -> ParticipationRound:
    """What the study's policy sees of one round attempt; its random stream is seeded by (seed, round, attempt)."""
    rng = random.Random((config.seed * 1_000_003 + round_number) * 1_009 + attempt)
    return ParticipationRound(tuple(config.sites), round_number, config.min_sites, rng, times)


def select_participants(
    config: StudyTerms,
    round_number: int,
    attempt: int = 1,
    round_seconds: Callable[[], Mapping[str, float]] | None = None,
) -> dict[str, float]:
    """Site -> load factor |all| / |selected| for one round, as the study's participation policy picks.

    The pick is deterministic in (seed, round, attempt), and in the sites' measured round times
    (`round_seconds()`: site -> last round time per unit of load, called only by policies that
    use it), so a restarted coordinator picks the same.
    """
    rule = PARTICIPATIONS[config.participation.name]
    times = dict(round_seconds()) if rule.uses_round_times and round_seconds is not None else {}
    round_ = _participation_round(config, round_number, attempt, times)
    chosen = list(dict.fromkeys(rule.select(round_, parsed_params(config.participation))))
    unknown = set(chosen) - set(config.sites)
    if unknown:
        raise StudyRuleError(f"participation {config.participation.name!r} picked sites outside the study: {unknown}")
    if len(chosen) < config.min_sites:
        raise StudyRuleError(f"participation {config.participation.name!r} picked {len(chosen)} < min_sites sites")
    return dict.fromkeys(chosen, load_factor(config, chosen))


def participation_problem(config: StudyTerms, round_number: int, attempt: int, chosen: Sequence[str]) -> str | None:
    """Why `chosen` cannot be the study's pick for this round attempt, or None when it can: what a site checks.

    A policy that reads no round times is recomputed whole; one that does (which a site cannot
    see) bounds how many sites it picks.
    """
    name = config.participation.name
    unknown = sorted(set(chosen) - set(config.sites))
    if unknown:
        return f"names sites outside the study's terms: {unknown}"
    if len(set(chosen)) != len(chosen):
        return "names a site twice"
    if len(chosen) < config.min_sites:
        return f"names {len(chosen)} sites, fewer than min_sites {config.min_sites}"
    rule = PARTICIPATIONS[name]
    if rule.sizes is not None:
        round_ = _participation_round(config, round_number, attempt, {})
        fewest, most = rule.sizes(round_, parsed_params(config.participation))
        if not fewest <= len(chosen) <= most:
            return f"names {len(chosen)} sites; {name!r} picks {fewest} to {most} in round {round_number}"
        return None
    expected = select_participants(config, round_number, attempt)
    if set(chosen) != set(expected):
        return f"names {sorted(chosen)}; {name!r} picks {sorted(expected)} in round {round_number} attempt {attempt}"
    return None
