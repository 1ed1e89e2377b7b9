"""The server's side of one simulated round: the study's weights and its update of theta^g, as the coordinator does.

A secure study runs the same SecAgg+ protocol in process (shared.privacy.simulate_secure_sum over
real client and server states) on the very ring vectors a site agent would mask
(shared.privacy.study_secagg), so its theta^g is bit-identical to the service's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from cardiofl.experiment.secure_simulation import simulate_secure_sum
from shared.algorithms.server import global_from_sums, next_global
from shared.algorithms.weightings import aggregation_weights
from shared.privacy.study_secagg import (
    decode_sum,
    round_parameters,
    site_numbers,
    survivor_weight_sum,
)
from shared.study import secure_layout, secure_site_vector, server_aggregator
from shared.terms import StudyTerms
from site_agent.local_round import LocalRoundResult

__all__ = ["aggregate_round"]


def aggregate_round(
    study: StudyTerms,
    previous: Mapping[str, Tensor],
    contributions: Sequence[tuple[str, LocalRoundResult]],
    *,
    round_no: int = 0,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """(theta^g_t, weight of each site) from theta^g_{t-1} and the sites' results, in the coordinator's order."""
    weights = aggregation_weights(
        [result.meta.num_examples for _, result in contributions],
        study.aggregation.name,
        study.aggregation.params,
        metrics=[result.meta.metrics.model_dump(mode="json") for _, result in contributions],
    )
    if study.privacy.secure_aggregation is not None:
        return _secure_round(
            study, previous, contributions, dict(zip((s for s, _ in contributions), weights, strict=True)), round_no
        )
    updates = [(result.shared, w) for (_, result), w in zip(contributions, weights, strict=True)]
    metas = [result.meta for _, result in contributions]
    theta = next_global(server_aggregator(study, [site for site, _ in contributions], metas), previous, updates)
    return theta, {site: w for (site, _), w in zip(contributions, weights, strict=True)}


def _secure_round(
    study: StudyTerms,
    previous: Mapping[str, Tensor],
    contributions: Sequence[tuple[str, LocalRoundResult]],
    weights: dict[str, float],
    round_no: int,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The server step on the sums through SecAgg+ in process: every site survives, as in a round without dropout."""
    secure = study.privacy.secure_aggregation
    assert secure is not None
    sites = [site for site, _ in contributions]
    layout = secure_layout(study.model, study.algorithm, train=True, fraction_bits=secure.fraction_bits)
    numbers = site_numbers(sites)
    ring = {
        numbers[site]: secure_site_vector(
            layout, study.model, study.algorithm, site, result.shared, weights[site], result.meta
        )
        for site, result in contributions
    }
    count, threshold, survivors = round_parameters(secure, len(sites))
    summed = simulate_secure_sum(
        ring, study_uid="runner", round_no=round_no, neighbour_count=count, threshold=threshold, min_survivors=survivors
    )
    weight_sum = survivor_weight_sum(weights, sites)
    decoded = decode_sum(layout, summed.ring_sum, weight_sum, len(sites))
    theta = global_from_sums(
        server_aggregator(study), previous, decoded.schema, decoded.sums, decoded.weight_sum, decoded.survivors
    )
    return theta, {site: weights[site] / weight_sum for site in sites}
