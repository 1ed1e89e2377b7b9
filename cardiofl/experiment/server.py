"""The server's side of one simulated round: the study's weights and its update of theta^g, as the coordinator does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from shared.algorithms.server import next_global
from shared.algorithms.weightings import aggregation_weights
from shared.protocol import StudyConfig
from shared.study import server_aggregator
from site_agent.local_round import LocalRoundResult

__all__ = ["aggregate_round"]


def aggregate_round(
    study: StudyConfig, previous: Mapping[str, Tensor], contributions: Sequence[tuple[str, LocalRoundResult]]
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """(theta^g_t, weight of each site) from theta^g_{t-1} and the sites' results, in the coordinator's order."""
    weights = aggregation_weights(
        [result.meta.num_examples for _, result in contributions],
        study.aggregation.name,
        study.aggregation.params,
        metrics=[result.meta.metrics.model_dump(mode="json") for _, result in contributions],
    )
    updates = [(result.shared, w) for (_, result), w in zip(contributions, weights, strict=True)]
    theta = next_global(server_aggregator(study), previous, updates)
    return theta, {site: w for (site, _), w in zip(contributions, weights, strict=True)}
