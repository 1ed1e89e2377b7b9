"""A released model evaluated at a site that did not train it: a validation site, or a site of an evaluate study.

The model is the study's global evaluation model (theta^g with phi_0: exchange.global_evaluation_state,
the site's "own" tensors being phi_0, since it has none of its own), scored on whichever of the site's
splits the job names. The agent (site_agent/jobs.py) and the in-process runner call the same function,
so a validation site's figures are the same in both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor

from shared.model.network import build_model, load_released
from shared.study.rules import algorithm_exchange, algorithm_model
from shared.terms import StudyTerms
from shared.wire.protocol import EvalSummary
from site_agent.data import SplitArrays
from site_agent.device import Runtime
from site_agent.local_round import TestPredictions, evaluate, round_seed, seeded_rng

__all__ = ["released_predictions", "released_summary"]


def released_predictions(
    terms: StudyTerms,
    site: str,
    *,
    global_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    splits: Sequence[SplitArrays],
    runtime: Runtime,
) -> TestPredictions:
    """Scores of theta^g with phi_0 on the records of `splits` together (each non-empty split, in order)."""
    model_spec = terms.model.for_site(site)
    exchange = algorithm_exchange(model_spec, terms.algorithm)
    received = {name: global_tensors[name] for name in exchange.partition.shared}
    state = exchange.global_evaluation_state(received, initial_local, initial_local)
    records = [split for split in splits if len(split)]
    if not records:
        raise ValueError(f"site {site} has no records to evaluate on")
    with seeded_rng(terms.seed, runtime):
        model = build_model(algorithm_model(model_spec, terms.algorithm), seed=terms.seed)
        model = load_released(model, state).to(runtime.device)
        parts = [evaluate(model, split, runtime) for split in records]
    return TestPredictions(
        np.concatenate([part.truth for part in parts]),
        np.concatenate([part.scores for part in parts]),
        sum(part.loss_sum for part in parts),
    )


def released_summary(
    terms: StudyTerms,
    site: str,
    round_number: int,
    *,
    global_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    splits: Sequence[SplitArrays],
    runtime: Runtime,
) -> EvalSummary:
    """The site's scalar report of theta^g_t with phi_0 on `splits` (clinical figures from privacy.min_records)."""
    predictions = released_predictions(
        terms, site, global_tensors=global_tensors, initial_local=initial_local, splits=splits, runtime=runtime
    )
    return predictions.summary(terms.privacy, round_seed(terms.seed, round_number, site))
