"""The server's step of one round, composed once: the study's weights, its algorithm's server update, theta^g_t.

The coordinator feeds it the stored updates window by window (coordinator/rounds/plain.py), the
in-process runner its sites' tensors in memory (cardiofl/experiment/server.py); a secure round
feeds it the unmasked sums instead (`server_round_from_sums`). Both callers give the same theta^g
bit for bit because this is the only place that composes the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from shared.algorithms.aggregation import WeightedAverage
from shared.algorithms.buffered import BufferedAggregator, base_weights, buffer_weights, staleness_factor
from shared.algorithms.server import ServerAggregator
from shared.algorithms.weightings import aggregation_weights, weighting_report
from shared.errors import StudyRuleError
from shared.study.buffered_dp import BufferedCentralNoise
from shared.study.rules import server_aggregator
from shared.tensors.codec import TensorDict, TensorSpec
from shared.terms import StudyTerms
from shared.wire.protocol import UpdateMeta

__all__ = [
    "SiteReport",
    "buffered_server_round",
    "round_weights",
    "server_round",
    "server_round_from_sums",
    "weights_read",
]

AddPrevious = Callable[[WeightedAverage], None]  # adds theta^g_{t-1} (with its server state) with weight 1
AddUpdates = Callable[[ServerAggregator, Sequence[float]], None]  # adds the updates, in the reports' order
AddBase = Callable[[WeightedAverage, int, float], None]  # adds theta^g_b of version b with weight U_b


@dataclass(frozen=True)
class SiteReport:
    """What a site reported with its update: what the weighting reads, and (learned heads) its head usage."""

    site: str
    num_examples: int
    metrics: Mapping[str, Any]  # UpdateMetrics as JSON
    meta: UpdateMeta | None = None  # needed only where the server weighs heads by uploaded usages


def round_weights(terms: StudyTerms, reports: Sequence[SiteReport]) -> list[float]:
    """Each report's normalised aggregation weight w_k, as the study's weighting gives it."""
    return aggregation_weights(
        [report.num_examples for report in reports],
        terms.aggregation.name,
        terms.aggregation.params,
        metrics=[report.metrics for report in reports],
    )


def weights_read(terms: StudyTerms, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What the study's weighting reads of a site's metrics: H_k under `uncertainty`, else nothing.

    A secure round's advertisement signs this `report`, and the coordinator relays it, with n_k, to
    the other sites: they compute every weight from it, and see no other metric of a peer.
    """
    return weighting_report(terms.aggregation.name, metrics)


def server_round(
    terms: StudyTerms, reports: Sequence[SiteReport], add_previous: AddPrevious, add_updates: AddUpdates
) -> tuple[TensorDict, list[float]]:
    """(theta^g_t, weights) of a round: the weights, then the algorithm's server update fed by the caller."""
    weights = round_weights(terms, reports)
    metas = [report.meta for report in reports if report.meta is not None]
    aggregator = server_aggregator(terms, [report.site for report in reports], metas)
    if aggregator.previous is not None:  # it also reads theta^g_{t-1} with the server state stored beside it
        add_previous(aggregator.previous)
    add_updates(aggregator, weights)
    return aggregator.result(), weights


def buffered_server_round(
    terms: StudyTerms,
    reports: Sequence[SiteReport],
    bases: Sequence[int],
    current: int,
    add_previous: AddPrevious,
    add_base: AddBase,
    add_updates: AddUpdates,
) -> tuple[TensorDict, list[float]]:
    """(theta^g_{v+1}, u_k) of a buffered study's release (shared/terms/buffered.py) from theta^g_v, v = `current`.

    The reports' weights w_k (the study's weighting within the buffer) times s(τ_k), τ_k = v - b_k of
    the version b_k each update trained from (`bases`, in the reports' order); each base version is
    added once with the summed u_k of the updates that left from it.
    """
    spec = terms.buffered
    if spec is None:
        raise StudyRuleError("the study has no buffered settings: its rounds are released by server_round")
    lags = [current - base for base in bases]
    weights = buffer_weights(round_weights(terms, reports), lags, spec.staleness)
    dp = terms.privacy.dp
    if dp is not None:  # central DP (checks.py allows no other here): each change noised against its own base
        factors = [staleness_factor(spec.staleness, lag) for lag in lags]
        noised = BufferedCentralNoise(dp, spec.server_lr, bases, factors)
        assert noised.previous is not None
        add_previous(noised.previous)
        for base in sorted(set(bases)):
            add_base(noised.version(base), base, 1.0)
        add_updates(noised, weights)
        return noised.result(), weights
    aggregator = BufferedAggregator(spec.server_lr)
    assert aggregator.previous is not None
    add_previous(aggregator.previous)
    for base, weight in base_weights(bases, weights).items():
        add_base(aggregator.bases, base, weight)
    add_updates(aggregator, weights)
    return aggregator.result(), weights


def server_round_from_sums(
    terms: StudyTerms,
    add_previous: AddPrevious,
    specs: Mapping[str, TensorSpec],
    sums: Mapping[str, Tensor],
    total_weight: float,
    count: int,
) -> TensorDict:
    """theta^g_t of a secure round: the same server update, given the survivors' sums (WeightedAverage.take_sums)."""
    aggregator = server_aggregator(terms)
    if aggregator.previous is not None:
        add_previous(aggregator.previous)
    aggregator.take_sums(specs, sums, total_weight, count)
    return aggregator.result()
