"""The in-process runner: every site's round and the server's aggregation, with the service's own classes.

No HTTP and no database, but the same functions the coordinator and the site agents call: the
participation policy (shared.study.rules.select_participants), a site's round
(site_agent.local_round.run_local_round, and run_local_evaluation for the final evaluation round),
the aggregation weights and the server update (shared.algorithms). Sites are visited in the
order the coordinator reads their updates (by name), so a run reproduces a study's theta^g bit for
bit on the CPU. A run yields its rounds' records (run_records); cardiofl/experiment/grid.py writes
them and schedules the runs of a grid. The final evaluation also records Global's
second reading, theta^g_T with the sites' phi_k averaged (cardiofl/experiment/readings.py), where the study
shares any model tensor (not under the local baseline, whose sites each train alone). Under
learned_heads, each training round's record also holds every participating site's gates g_{k,b,h}
after the round (`sites.<site>.gates`, one list of H per block), read from its private phi_k.

Validation sites (the study's `validation_sites`) never train nor enter any aggregation: after each
released theta^g_t with t a multiple of `validation_every`, and after the final one, each evaluates it
with phi_0 on all its records through site_agent/released_evaluation.py, the function a validation
site's agent calls for its external job, and the round's record holds it as `external.<site>`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.readings import PHI_K_AVERAGED, averaged_local_reading
from cardiofl.experiment.server import aggregate_round
from shared.algorithms.learned_heads import head_usage
from shared.evaluation.metrics import Summary
from shared.evaluation.summaries import pooled_summaries, site_summaries
from shared.model.network import ModelConfig, preset
from shared.study.accounting import trained_rounds
from shared.study.dp import seeded_noise
from shared.study.rules import algorithm_model, initial_state, select_participants, study_exchange, study_partition
from shared.tensors.codec import TensorDict, dump
from shared.terms import StudyTerms
from shared.wire.protocol import EvalSummary
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.planted import planted_sites
from site_agent.device import Runtime
from site_agent.local_round import LocalRoundResult, LocalRoundSpec, run_local_evaluation, run_local_round
from site_agent.released_evaluation import released_summary

__all__ = [
    "RoundOutcome",
    "external_summaries",
    "FinishedRun",
    "InTurn",
    "Kept",
    "SiteRounds",
    "gates",
    "load_sites",
    "run_params",
    "run_records",
    "run_slug",
    "simulate_study",
    "site_round",
    "whole_run",
]

log = logging.getLogger(__name__)


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
        }


def gates(state: TensorDict, config: ModelConfig) -> list[list[float]]:
    """A site's gates g_{b,h} = 1 - u_{b,h} from the gate logits in its phi_k (shared/algorithms/learned_heads.py)."""
    return [[1.0 - usage for usage in block] for block in head_usage(state, config)]


class SiteRounds(Protocol):
    """Where a round's sites run: one after another in this process (InTurn), or each a Ray task (ray_sites.py)."""

    def train(
        self, study: StudyTerms, number: int, participants: Sequence[str], theta: TensorDict, kept: Kept
    ) -> dict[str, LocalRoundResult]:
        """Each of `participants`' round `number` from theta^g_{t-1} and what it kept (site_round)."""
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
        """Each participant's round in turn."""
        tensors, phi_0 = kept
        return {
            site: site_round(
                study, site, number, participants, theta, tensors[site], phi_0, self.data[site], self.runtime
            )
            for site in sorted(participants)
        }

    def evaluate(self, study: StudyTerms, number: int, theta: TensorDict, kept: Kept) -> dict[str, LocalRoundResult]:
        """Every site's final evaluation in turn."""
        tensors, phi_0 = kept
        return {
            site: site_round(study, site, number, None, theta, tensors[site], phi_0, self.data[site], self.runtime)
            for site in sorted(study.sites)
        }


def simulate_study(
    study: StudyTerms,
    data: dict[str, SiteData],
    runtime: Runtime,
    *,
    evaluate_final: bool = True,
    sites: SiteRounds | None = None,
) -> Iterator[RoundOutcome]:
    """Run `study` as the coordinator and its agents would, yielding each round (and the final evaluation).

    `sites` runs the sites' rounds (default: InTurn, in this process); the server step, validation sites
    and the final readings run here. Every random stream derives from the study's seed, DP noise included
    (shared/study/dp.py seeded_noise), so where the sites run changes no number.
    """
    if study.buffered is not None:
        raise ValueError("this runner does not simulate buffered studies yet")
    sites = sites or InTurn(data, runtime)
    partition = study_partition(study)
    theta, phi_0 = initial_state(study)
    private: dict[str, TensorDict] = {}  # each site's committed phi_k (and algorithm state)
    seconds: dict[str, float] = {}  # each site's last round time per unit of load (centre dropout)
    weights: dict[str, float] = {}  # the weights of the last round: those theta^g_t was aggregated with
    trained = trained_rounds(study)  # all T, or what the epsilon budget allows
    config = algorithm_model(study.model, study.algorithm)
    for number in range(1, trained + 1):
        participants = select_participants(study, number, round_seconds=lambda: seconds)
        kept = {site: private.get(site, phi_0) for site in participants}
        results = sites.train(study, number, sorted(participants), theta, (kept, phi_0))
        for site, result in results.items():
            private[site] = result.local
            seconds[site] = result.meta.train_seconds / participants[site]
        with seeded_noise(f"{study.seed}|{number}|server"):
            theta, weights = aggregate_round(
                study, theta, [(site, results[site]) for site in sorted(results)], round_no=number
            )
        learned = {site: gates(private[site], config) for site in results} if config.learned_heads else {}
        external = external_summaries(study, number, theta, phi_0, data, runtime, final=number == trained)
        yield RoundOutcome(number, "train", theta, results, weights, gates=learned, external=external)
    if not evaluate_final:
        return
    final = sites.evaluate(study, trained + 1, theta, ({site: private.get(site, phi_0) for site in study.sites}, phi_0))
    # no theta^g where nothing is shared (the local baseline): averaging the sites' own models is another method
    shares = bool(partition.shared)
    readings = {PHI_K_AVERAGED: averaged_local_reading(study, theta, private, weights, data, runtime)} if shares else {}
    yield RoundOutcome(study.rounds + 1, "evaluate", theta, final, {}, readings)


def external_summaries(
    study: StudyTerms,
    number: int,
    theta: TensorDict,
    initial_local: TensorDict,
    data: dict[str, SiteData],
    runtime: Runtime,
    *,
    final: bool,
) -> dict[str, EvalSummary]:
    """Each validation site's report of theta^g_`number` with phi_0 on all its records, where the round is due."""
    if number % study.validation_every and not final:
        return {}
    return {
        site: released_summary(
            study,
            site,
            number,
            global_tensors=theta,
            initial_local=initial_local,
            splits=[data[site].train, data[site].test],
            runtime=runtime,
        )
        for site in study.validation_sites
    }


def load_sites(config: ExperimentConfig) -> dict[str, SiteData]:
    """Each site's preprocessed data: from its folders, the synthetic generator (cached) or the planted teacher."""
    cache = Path(config.cache_dir)
    if config.sites:
        return {site.name: open_site_data(site.data, cache / site.name) for site in config.sites}
    if config.planted is not None:
        return _planted_sites(config)
    from site_agent.data.synthetic import generate_sites

    synthetic = config.synthetic
    assert synthetic is not None
    root = (
        cache / f"synthetic-{synthetic.sites}x{synthetic.records_per_site}-s{synthetic.seed}-h{synthetic.heterogeneity}"
    )
    folders = sorted(root.glob("raw/site_*"))
    if len(folders) != synthetic.sites:
        folders = generate_sites(
            root / "raw",
            synthetic.sites,
            synthetic.records_per_site,
            synthetic.seed,
            heterogeneity=synthetic.heterogeneity,
        )
    names = config.site_names()
    return {
        name: open_site_data(ChallengeSource(path=folder, name=name), root / "cache" / name)
        for name, folder in zip(names, folders, strict=True)
    }


def _planted_sites(config: ExperimentConfig) -> dict[str, SiteData]:
    """The planted-truth sites, generated in memory for the experiment's model preset."""
    assert config.planted is not None
    names = config.site_names()
    sites = planted_sites(preset(config.preset), config.planted, names, Path(config.cache_dir))
    return dict(zip(names, sites, strict=True))


def run_records(
    config: ExperimentConfig,
    key: RunKey,
    data: dict[str, SiteData],
    runtime: Runtime,
    sites: SiteRounds | None = None,
) -> Iterator[tuple[dict[str, Any], TensorDict]]:
    """One run of the grid: each round's record (without its attempt), with theta^g after the round."""
    study = config.study(key)
    n_classes = study.model.config().n_classes
    for outcome in simulate_study(study, data, runtime, sites=sites):
        record = {
            "type": "round",
            "run": key.id,
            **key.model_dump(),
            "min_records": study.privacy.min_records,
            "site_order": study.sites,  # the config's order: the report's columns follow it
            "global_label": study_exchange(study).global_label(),  # what the pooled Global model is
            **_planted_record(config),
            **outcome.record(n_classes),
        }
        yield record, outcome.global_model


def _planted_record(config: ExperimentConfig) -> dict[str, Any]:
    """Planted sites: each site's planted H_l^(k), for the report to judge the learned gates by."""
    if config.planted is None:
        return {}
    return {"planted_local_heads": dict(zip(config.site_names(), config.planted.local_heads, strict=True))}


def run_params(key: RunKey) -> dict[str, str]:
    """A run's key as tracker parameters."""
    return {"run": key.id, "run.method": key.method, "run.heads": key.heads, "run.seed": str(key.seed)}


def run_slug(key: RunKey) -> str:
    """A run's key as a file name ("FedDualAtt-6-2-0")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{key.method}-{key.heads}-{key.seed}")


# What a run done away from the driver sends back: its round records, theta^g_T as safetensors, its seconds.
FinishedRun = tuple[list[dict[str, Any]], bytes | None, float]


def whole_run(
    config: ExperimentConfig,
    key: RunKey,
    data: dict[str, SiteData],
    runtime: Runtime,
    sites: SiteRounds | None = None,
) -> FinishedRun:
    """One run of the grid at once (a worker's or a Ray task's), for the driver to write (grid.py)."""
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    final: TensorDict | None = None
    for record, theta in run_records(config, key, data, runtime, sites):
        records.append(record)
        final = theta
    return records, dump(final) if final is not None else None, time.perf_counter() - started
