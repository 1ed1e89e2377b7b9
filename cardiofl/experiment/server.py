"""The server's side of one simulated round: the study's weights and its update of theta^g, as the coordinator does.

The step itself is shared/study/server_round.py's, which the coordinator composes the same way; here the
updates are the sites' tensors in memory. A secure study runs the same SecAgg+ protocol in process
(cardiofl.experiment.secure_simulation over real client and server states) on the very ring
vectors a site agent would mask (shared.study.secagg), so its theta^g is bit-identical to
the service's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from cardiofl.experiment.secure_simulation import simulate_secure_sum
from shared.algorithms.aggregation import WeightedAverage
from shared.algorithms.server import ServerAggregator
from shared.study.round_terms import secure_round_key
from shared.study.rules import add_secure_sum_noise, secure_layout, secure_site_vector
from shared.study.secagg import decode_sum, survivor_weight_sum
from shared.study.secure_setup import colluding_sites, round_parameters, site_numbers
from shared.study.server_round import (
    SiteReport,
    buffered_server_round,
    round_weights,
    server_round,
    server_round_from_sums,
)
from shared.terms import StudyTerms
from site_agent.local_round import LocalRoundResult

__all__ = ["aggregate_buffer", "aggregate_round"]


def aggregate_round(
    study: StudyTerms,
    previous: Mapping[str, Tensor],
    contributions: Sequence[tuple[str, LocalRoundResult]],
    *,
    round_no: int = 0,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """(theta^g_t, weight of each site) from theta^g_{t-1} and the sites' results, in the coordinator's order."""
    reports = [_report(site, result) for site, result in contributions]

    def add_previous(average: WeightedAverage) -> None:
        average.add(previous, 1.0)

    if study.privacy.secure_aggregation is not None:
        weights = dict(zip((site for site, _ in contributions), round_weights(study, reports), strict=True))
        return _secure_round(study, previous, add_previous, contributions, weights, round_no)

    def add_updates(aggregator: ServerAggregator, weights: Sequence[float]) -> None:
        for (_, result), weight in zip(contributions, weights, strict=True):
            aggregator.add(result.shared, weight)

    theta, site_weights = server_round(study, reports, add_previous, add_updates)
    return theta, {site: w for (site, _), w in zip(contributions, site_weights, strict=True)}


def aggregate_buffer(
    study: StudyTerms,
    versions: Mapping[int, Mapping[str, Tensor]],
    current: int,
    contributions: Sequence[tuple[str, LocalRoundResult, int]],
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """(theta^g_{v+1}, u_k by site) of a buffered release from theta^g_v (v = `current`) and (site, result, b_k)."""
    reports = [_report(site, result) for site, result, _ in contributions]

    def add_previous(average: WeightedAverage) -> None:
        average.add(versions[current], 1.0)

    def add_base(average: WeightedAverage, base: int, weight: float) -> None:
        average.add(versions[base], weight)

    def add_updates(aggregator: ServerAggregator, weights: Sequence[float]) -> None:
        for (_, result, _), weight in zip(contributions, weights, strict=True):
            aggregator.add(result.shared, weight)

    bases = [base for _, _, base in contributions]
    theta, weights = buffered_server_round(study, reports, bases, current, add_previous, add_base, add_updates)
    return theta, {site: w for (site, _, _), w in zip(contributions, weights, strict=True)}


def _report(site: str, result: LocalRoundResult) -> SiteReport:
    """What the server's weighting reads of a site's round, as the coordinator reads it from the upload's meta."""
    return SiteReport(site, result.meta.num_examples, result.meta.metrics.model_dump(mode="json"), result.meta)


def _secure_round(
    study: StudyTerms,
    previous: Mapping[str, Tensor],
    add_previous: Callable[[WeightedAverage], None],
    contributions: Sequence[tuple[str, LocalRoundResult]],
    weights: dict[str, float],
    round_no: int,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The server step on the sums through SecAgg+ in process: every site survives, as in a round without dropout."""
    secure = study.privacy.secure_aggregation
    assert secure is not None
    sites = [site for site, _ in contributions]
    layout = secure_layout(
        study.model, study.algorithm, train=True, fraction_bits=secure.fraction_bits, ring_bits=secure.ring_bits
    )
    numbers = site_numbers(sites)
    ring = {
        numbers[site]: secure_site_vector(
            layout,
            study.model,
            study.algorithm,
            site,
            result.shared,
            weights[site],
            result.meta,
            base=previous,
            grid=result.grid,
        )
        for site, result in contributions
    }
    parameters = round_parameters(secure, len(sites), colluding_sites(study))
    summed = simulate_secure_sum(
        ring,
        study_uid="runner",
        round_no=secure_round_key(round_no, 1),
        neighbour_count=parameters.neighbour_count,
        threshold=parameters.threshold,
        min_survivors=parameters.min_survivors,
        quorum=parameters.signature_quorum,
    )
    add_secure_sum_noise(study, layout, summed.ring_sum)  # central DP: the coordinator's noise on the sum
    decoded = decode_sum(layout, summed.ring_sum, len(sites), base=previous)  # the weight sum is unmasked with the rest
    theta = server_round_from_sums(
        study, add_previous, decoded.schema, decoded.sums, decoded.weight_sum, decoded.survivors
    )
    shown = survivor_weight_sum(weights, sites)
    return theta, {site: weights[site] / shown for site in sites}
