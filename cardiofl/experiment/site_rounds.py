"""A simulated round's pieces: a site's round, where a round's sites run, and what a round produced.

site_round is the one function every simulated site's round goes through (in turn here, as a Ray
task in ray_sites.py, or as a buffered study's update in buffered.py); RoundOutcome is a round's
result as the experiment's records hold it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.algorithms.learned_heads import head_usage
from shared.evaluation.metrics import Summary
from shared.evaluation.summaries import pooled_summaries, site_summaries
from shared.model.network import ModelConfig
from shared.study.dp import seeded_noise
from shared.study.rules import study_partition
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from shared.wire.protocol import EvalSummary
from site_agent.data import SiteData
from site_agent.data.loader import SplitArrays
from site_agent.device import Runtime
from site_agent.local_round import LocalRoundResult, LocalRoundSpec, run_local_evaluation, run_local_round
from site_agent.released_evaluation import released_summary

__all__ = [
    "BufferFacts",
    "InTurn",
    "Kept",
    "RoundOutcome",
    "SiteRounds",
    "external_summaries",
    "gates",
    "site_round",
    "site_test_readings",
]


@dataclass(frozen=True)
class BufferFacts:
    """A buffered study's release: the version each member trained from, and who came too stale."""

    bases: dict[str, int]  # site -> b_k, the version of theta^g its update trained from
    refused: tuple[str, ...] = ()  # sites whose update arrived more than max_staleness behind while it was open

    def record(self, version: int) -> dict[str, Any]:
        """The release's part of its round record: bases and staleness tau_k = version - 1 - b_k by site."""
        return {
            "bases": dict(self.bases),
            "staleness": {site: version - 1 - base for site, base in self.bases.items()},
            "refused": list(self.refused),
        }


@dataclass(frozen=True)
class RoundOutcome:
    """What one simulated round produced (round T+1 is the final evaluation: `global_model` is theta^g_T)."""

    round: int
    kind: str  # "train" or "evaluate"
    global_model: TensorDict  # theta^g_t after this round (unchanged by the evaluation round)
    results: dict[str, LocalRoundResult]  # by site
    weights: dict[str, float]
    readings: dict[str, Summary] = field(default_factory=dict)  # other readings of theta^g_T by label (final only)
    gates: dict[str, list[list[float]]] = field(default_factory=dict)  # learned_heads: site -> g_{k,b,h} after it
    external: dict[str, EvalSummary] = field(default_factory=dict)  # validation site -> theta^g_t on all its records
    buffer: BufferFacts | None = None  # a buffered study's release: its members' bases, its clock
    clock: float | None = None  # simulated seconds since the study began, once theta^g_t is released
    by_site: dict[str, EvalSummary] = field(default_factory=dict)  # theta^g_t on each site's test split (on ask)

    def record(self, n_classes: int) -> dict[str, Any]:
        """The JSON record of this round: per-site and pooled summaries as the coordinator makes them."""
        reports = {site: result.meta.metrics.model_dump(mode="json") for site, result in self.results.items()}
        sites: dict[str, dict[str, Any]] = {}
        for site, result in self.results.items():
            summaries = site_summaries(reports[site], n_classes)
            sites[site] = {
                "n": result.meta.num_examples,
                "weight": self.weights.get(site),
                "train_loss": result.meta.metrics.loss if self.kind == "train" else None,
                "local": summaries["local_eval"],  # the site's personalised model, exact at the site
                "previous_global": summaries["eval"],  # theta^g_{t-1} with phi_0: its contribution, or the marker
            }
            if site in self.gates:  # learned_heads only: other algorithms' records are as before
                sites[site]["gates"] = self.gates[site]
        pooled = pooled_summaries(
            ((r.meta.num_examples, reports[site]) for site, r in self.results.items()),
            n_classes,
            trained=self.kind == "train",
        )
        return {
            "round": self.round,
            "kind": self.kind,
            "train_loss": pooled["train_loss"],
            "sites": sites,
            "local": pooled["local_eval"],  # the personalised models' metrics averaged over test records
            "previous_global": pooled["eval"],  # theta^g_{t-1} pooled over the sites with enough records
            "global_readings": self.readings,  # e.g. theta^g_T with the sites' phi_k averaged (simulation only)
            # validation sites, in rounds they evaluate theta^g_t: as their agents report it (absent otherwise)
            **(
                {"external": {site: s.model_dump(mode="json") for site, s in self.external.items()}}
                if self.external
                else {}
            ),
            **({"buffer": self.buffer.record(self.round)} if self.buffer is not None else {}),
            **({"clock": self.clock} if self.clock is not None else {}),
            **(
                {"global_by_site": {site: s.model_dump(mode="json") for site, s in self.by_site.items()}}
                if self.by_site
                else {}
            ),
        }


def gates(state: TensorDict, config: ModelConfig) -> list[list[float]]:
    """A site's gates g_{b,h} = 1 - u_{b,h} from the gate logits in its phi_k (shared/algorithms/learned_heads.py)."""
    return [[1.0 - usage for usage in block] for block in head_usage(state, config)]


class SiteRounds(Protocol):
    """Where a round's sites run: one after another in this process (InTurn), or each a Ray task (ray_sites.py)."""

    def train(
        self, study: StudyTerms, number: int, participants: Sequence[str], theta: TensorDict, kept: Kept
    ) -> dict[str, LocalRoundResult]:
        """The round `number` among `participants` of each site in `kept` (those whose update arrives; site_round)."""
        ...

    def evaluate(self, study: StudyTerms, number: int, theta: TensorDict, kept: Kept) -> dict[str, LocalRoundResult]:
        """Every site's final evaluation of theta^g_T (round `number`)."""
        ...


# Each site's kept tensors going into a round, and phi_0: (site -> phi_k or phi_0, phi_0)
Kept = tuple[Mapping[str, TensorDict], TensorDict]


def site_round(
    study: StudyTerms,
    site: str,
    number: int,
    participants: Sequence[str] | None,
    theta: TensorDict,
    kept: TensorDict,
    initial_local: TensorDict,
    data: SiteData,
    runtime: Runtime,
) -> LocalRoundResult:
    """`site`'s round `number` among `participants` (None: the final evaluation), its DP noise seeded by the study."""
    with seeded_noise(f"{study.seed}|{number}|{site}"):
        if participants is None:
            return run_local_evaluation(
                LocalRoundSpec.of(study, site, number),
                global_tensors=theta,
                local_tensors=kept,
                initial_local=initial_local,
                data=data,
                runtime=runtime,
            )
        return run_local_round(
            LocalRoundSpec.of(study, site, number, participants),
            study_partition(study),
            global_tensors=theta,
            local_tensors=kept,
            initial_local=initial_local,
            data=data,
            runtime=runtime,
        )


@dataclass(frozen=True)
class InTurn:
    """The sites of a round one after another in this process, in the order the coordinator reads them."""

    data: Mapping[str, SiteData]
    runtime: Runtime

    def train(
        self, study: StudyTerms, number: int, participants: Sequence[str], theta: TensorDict, kept: Kept
    ) -> dict[str, LocalRoundResult]:
        """Each kept site's round in turn."""
        tensors, phi_0 = kept
        return {
            site: site_round(
                study, site, number, participants, theta, tensors[site], phi_0, self.data[site], self.runtime
            )
            for site in sorted(tensors)
        }

    def evaluate(self, study: StudyTerms, number: int, theta: TensorDict, kept: Kept) -> dict[str, LocalRoundResult]:
        """Every site's final evaluation in turn."""
        tensors, phi_0 = kept
        return {
            site: site_round(study, site, number, None, theta, tensors[site], phi_0, self.data[site], self.runtime)
            for site in sorted(study.sites)
        }


def external_summaries(
    study: StudyTerms,
    number: int,
    theta: TensorDict,
    initial_local: TensorDict,
    data: Mapping[str, SiteData],
    runtime: Runtime,
    *,
    final: bool,
) -> dict[str, EvalSummary]:
    """Each validation site's report of theta^g_`number` with phi_0 on all its records, where the round is due."""
    if number % study.validation_every and not final:
        return {}
    splits = {site: [data[site].train, data[site].test] for site in study.validation_sites}
    return _released(study, number, theta, initial_local, splits, runtime)


def site_test_readings(
    study: StudyTerms,
    number: int,
    theta: TensorDict,
    initial_local: TensorDict,
    data: Mapping[str, SiteData],
    runtime: Runtime,
) -> dict[str, EvalSummary]:
    """theta^g_`number` with phi_0 on each training site's test split, as a validation site would read it."""
    return _released(study, number, theta, initial_local, {site: [data[site].test] for site in study.sites}, runtime)


def _released(
    study: StudyTerms,
    number: int,
    theta: TensorDict,
    initial_local: TensorDict,
    splits: Mapping[str, list[SplitArrays]],
    runtime: Runtime,
) -> dict[str, EvalSummary]:
    """theta^g_`number` with phi_0 read on each site's `splits` (site_agent/released_evaluation.py)."""
    return {
        site: released_summary(
            study, site, number, global_tensors=theta, initial_local=initial_local, splits=chosen, runtime=runtime
        )
        for site, chosen in splits.items()
    }
