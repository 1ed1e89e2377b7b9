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
from dataclasses import replace
from pathlib import Path
from typing import Any

from cardiofl.experiment.buffered import Buffer, simulate_buffered
from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.readings import PHI_K_AVERAGED, averaged_local_reading
from cardiofl.experiment.server import aggregate_round
from cardiofl.experiment.site_rounds import (
    InTurn,
    RoundOutcome,
    SiteRounds,
    external_summaries,
    gates,
    site_test_readings,
)
from shared.model.network import preset
from shared.study.accounting import trained_rounds
from shared.study.dp import seeded_noise
from shared.study.rules import algorithm_model, initial_state, select_participants, study_exchange, study_partition
from shared.tensors.codec import TensorDict, dump
from shared.terms import StudyTerms
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.planted import planted_sites
from site_agent.device import Runtime

__all__ = [
    "FinishedRun",
    "load_sites",
    "run_params",
    "run_records",
    "run_slug",
    "simulate_study",
    "whole_run",
]

log = logging.getLogger(__name__)


def simulate_study(
    study: StudyTerms,
    data: dict[str, SiteData],
    runtime: Runtime,
    *,
    evaluate_final: bool = True,
    sites: SiteRounds | None = None,
    site_seconds: Mapping[str, float] | None = None,
    schedule: Sequence[Buffer] | None = None,
    site_readings: bool = False,
) -> Iterator[RoundOutcome]:
    """Run `study` as the coordinator and its agents would, yielding each round (and the final evaluation).

    `sites` runs the sites' rounds (default: InTurn, in this process); the server step, validation sites
    and the final readings run here. Every random stream derives from the study's seed, DP noise included
    (shared/study/dp.py seeded_noise), so where the sites run changes no number. A buffered study's
    releases come from buffered.py, its sites in turn: on a simulated clock where site k's round takes
    `site_seconds[k]` (1 by default), or as `schedule` says (a service's buffers, replayed). On that clock
    a synchronous round lasts as long as its slowest site, or its deadline (`round_deadline_s`), which
    drops a site whose round takes longer; given `site_seconds`, centre dropout's "slowest" reads it
    instead of the measured times. With `site_readings` each training round also reads theta^g_t on
    every site's test split.
    """
    start = initial_state(study)
    private: dict[str, TensorDict] = {}  # each site's committed phi_k (and algorithm state), as rounds go
    if study.buffered is not None:
        if sites is not None and not isinstance(sites, InTurn):
            raise ValueError("a buffered study's sites train one update at a time, in turn: not as Ray tasks")
        rounds = simulate_buffered(study, data, runtime, start, private, seconds=site_seconds, schedule=schedule)
    else:
        rounds = _synchronous_rounds(
            study, data, runtime, sites or InTurn(data, runtime), start, private, site_seconds=site_seconds
        )
    theta, phi_0 = start
    weights: dict[str, float] = {}  # the weights of the last round: those theta^g_T was aggregated with
    for outcome in rounds:
        theta, weights = outcome.global_model, outcome.weights
        if site_readings:
            outcome = replace(outcome, by_site=site_test_readings(study, outcome.round, theta, phi_0, data, runtime))
        yield outcome
    if not evaluate_final:
        return
    trained = trained_rounds(study)
    kept = {site: private.get(site, phi_0) for site in study.sites}
    final = (sites or InTurn(data, runtime)).evaluate(study, trained + 1, theta, (kept, phi_0))
    # no theta^g where nothing is shared (the local baseline): averaging the sites' own models is another method
    shares = bool(study_partition(study).shared)
    readings = {PHI_K_AVERAGED: averaged_local_reading(study, theta, private, weights, data, runtime)} if shares else {}
    yield RoundOutcome(study.rounds + 1, "evaluate", theta, final, {}, readings)


def _synchronous_rounds(
    study: StudyTerms,
    data: dict[str, SiteData],
    runtime: Runtime,
    sites: SiteRounds,
    start: tuple[TensorDict, TensorDict],
    private: dict[str, TensorDict],
    *,
    site_seconds: Mapping[str, float] | None,
) -> Iterator[RoundOutcome]:
    """Each training round of a synchronous study: its participants' rounds, then the server's step."""
    theta, phi_0 = start
    seconds: dict[str, float] = {}  # each site's last round time per unit of load (centre dropout)
    trained = trained_rounds(study)  # all T, or what the epsilon budget allows
    config = algorithm_model(study.model, study.algorithm)
    clock = 0.0
    for number in range(1, trained + 1):
        participants = select_participants(study, number, round_seconds=lambda: seconds)
        lasted, arriving = _in_time(study, participants, site_seconds or {})
        clock += lasted
        kept = {site: private.get(site, phi_0) for site in arriving}  # a site past the deadline: nothing arrives
        results = sites.train(study, number, sorted(participants), theta, (kept, phi_0))
        for site, result in results.items():
            private[site] = result.local
            measured = result.meta.train_seconds / participants[site]
            seconds[site] = site_seconds.get(site, 1.0) if site_seconds else measured
        with seeded_noise(f"{study.seed}|{number}|server"):
            theta, weights = aggregate_round(
                study, theta, [(site, results[site]) for site in sorted(results)], round_no=number
            )
        learned = {site: gates(private[site], config) for site in results} if config.learned_heads else {}
        external = external_summaries(study, number, theta, phi_0, data, runtime, final=number == trained)
        yield RoundOutcome(number, "train", theta, results, weights, gates=learned, external=external, clock=clock)


def _in_time(
    study: StudyTerms, participants: Mapping[str, float], site_seconds: Mapping[str, float]
) -> tuple[float, list[str]]:
    """(simulated seconds the round lasts, the participants that meet its deadline): site k takes seconds[k] x load."""
    took = {site: site_seconds.get(site, 1.0) * load for site, load in participants.items()}
    arriving = sorted(site for site, seconds in took.items() if seconds <= study.round_deadline_s)
    if len(arriving) < study.min_sites:
        raise ValueError(
            f"only {len(arriving)} site(s) meet the round deadline of {study.round_deadline_s} simulated seconds; "
            f"min_sites is {study.min_sites}"
        )
    lasted = max(took[site] for site in arriving) if len(arriving) == len(took) else study.round_deadline_s
    return lasted, arriving


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
    exclusive = f"-x{synthetic.exclusive_classes}" if synthetic.exclusive_classes else ""
    root = (
        cache / f"synthetic-{synthetic.sites}x{synthetic.records_per_site}-s{synthetic.seed}-h{synthetic.heterogeneity}"
        f"{exclusive}"
    )
    folders = sorted(root.glob("raw/site_*"))
    if len(folders) != synthetic.sites:
        folders = generate_sites(
            root / "raw",
            synthetic.sites,
            synthetic.records_per_site,
            synthetic.seed,
            heterogeneity=synthetic.heterogeneity,
            exclusive_classes=synthetic.exclusive_classes,
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
    if study.buffered is not None:  # a buffered study's updates train one at a time, in turn (buffered.py)
        sites = None
    for outcome in simulate_study(
        study, data, runtime, sites=sites, site_seconds=config.site_seconds, site_readings=config.site_readings
    ):
        record = {
            "type": "round",
            "run": key.id,
            **key.model_dump(),
            "min_records": study.privacy.min_records,
            "site_order": study.sites,  # the config's order: the report's columns follow it
            "global_label": study_exchange(study).global_label(),  # what the pooled Global model is
            **_planted_record(config),
            **({"site_seconds": config.site_seconds} if config.site_seconds else {}),
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
