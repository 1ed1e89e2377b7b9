"""The in-process runner: every site's round and the server's aggregation, with the service's own classes.

No HTTP and no database, but the same functions the coordinator and the site agents call: the
participation policy (shared.study.rules.select_participants), a site's round
(site_agent.local_round.run_local_round, and run_local_evaluation for the final evaluation round),
the aggregation weights and the server update (shared.algorithms). Sites are visited in the
order the coordinator reads their updates (by name), so a run reproduces a study's theta^g bit for
bit on the CPU. Results go to a JSON-lines file as each round ends; an interrupted experiment
resumes with the first run that has not finished. The final evaluation also records Global's
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

import json
import logging
import multiprocessing
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.readings import PHI_K_AVERAGED, averaged_local_reading
from cardiofl.experiment.server import aggregate_round
from cardiofl.tracking import RunTracking, Tracker
from shared.algorithms.learned_heads import head_usage
from shared.evaluation.metrics import Summary
from shared.evaluation.summaries import pooled_summaries, site_summaries
from shared.model.network import ModelConfig, preset
from shared.study.accounting import trained_rounds
from shared.study.rules import algorithm_model, initial_state, select_participants, study_exchange, study_partition
from shared.tensors.codec import TensorDict, dump
from shared.terms import StudyTerms
from shared.wire.protocol import EvalSummary
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.planted import planted_sites
from site_agent.device import Runtime, resolve_runtime
from site_agent.local_round import LocalRoundResult, LocalRoundSpec, run_local_evaluation, run_local_round
from site_agent.released_evaluation import released_summary

__all__ = [
    "RoundOutcome",
    "external_summaries",
    "finished_runs",
    "gates",
    "load_sites",
    "run_experiment",
    "run_params",
    "run_records",
    "run_slug",
    "simulate_study",
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


def simulate_study(
    study: StudyTerms, data: dict[str, SiteData], runtime: Runtime, *, evaluate_final: bool = True
) -> Iterator[RoundOutcome]:
    """Run `study` as the coordinator and its agents would, yielding each round (and the final evaluation)."""
    partition = study_partition(study)
    theta, phi_0 = initial_state(study)
    private: dict[str, TensorDict] = {}  # each site's committed phi_k (and algorithm state)
    seconds: dict[str, float] = {}  # each site's last round time per unit of load (centre dropout)
    weights: dict[str, float] = {}  # the weights of the last round: those theta^g_t was aggregated with
    trained = trained_rounds(study)  # all T, or what the epsilon budget allows
    config = algorithm_model(study.model, study.algorithm)
    for number in range(1, trained + 1):
        participants = select_participants(study, number, round_seconds=lambda: seconds)
        results: dict[str, LocalRoundResult] = {}
        for site in sorted(participants):
            spec = LocalRoundSpec.of(study, site, number, list(participants))
            results[site] = run_local_round(
                spec,
                partition,
                global_tensors=theta,
                local_tensors=private.get(site, phi_0),
                initial_local=phi_0,
                data=data[site],
                runtime=runtime,
            )
            private[site] = results[site].local
            seconds[site] = results[site].meta.train_seconds / participants[site]
        theta, weights = aggregate_round(
            study, theta, [(site, results[site]) for site in sorted(results)], round_no=number
        )
        learned = {site: gates(private[site], config) for site in results} if config.learned_heads else {}
        external = external_summaries(study, number, theta, phi_0, data, runtime, final=number == trained)
        yield RoundOutcome(number, "train", theta, results, weights, gates=learned, external=external)
    if not evaluate_final:
        return
    final: dict[str, LocalRoundResult] = {}
    for site in sorted(study.sites):
        spec = LocalRoundSpec.of(study, site, trained + 1)
        final[site] = run_local_evaluation(
            spec,
            global_tensors=theta,
            local_tensors=private.get(site, phi_0),
            initial_local=phi_0,
            data=data[site],
            runtime=runtime,
        )
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


def finished_runs(results: Path) -> set[str]:
    """Ids of the runs whose every round is in `results`."""
    if not results.exists():
        return set()
    done = set()
    for line in results.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("type") == "run_done":
                done.add(record["run"])
    return done


def run_experiment(
    config: ExperimentConfig,
    results: Path,
    *,
    runtime: Runtime | None = None,
    on_round: Callable[[RunKey, dict[str, Any]], None] | None = None,
    trackers: Callable[[RunKey], Sequence[Tracker]] | None = None,
    jobs: int = 1,
) -> list[RunKey]:
    """Run every grid point not finished yet, appending records to `results`; returns the runs it ran.

    `trackers(key)` gives each run's experiment trackers (cardiofl.tracking: MLflow, TensorBoard):
    they get the run's key and terms, each round's scalars, and theta^g_T, as `cardiofl study track`
    logs a study of the same terms. With `jobs` > 1 that many runs go at a time, each in a worker
    process of its own (the device's threads shared out between them); a run's records are then
    written, and passed to `on_round` and the trackers, when it has finished, and every run's
    records are those it would have alone with a worker's threads (each resolves the experiment's device).
    """
    runtime = runtime or resolve_runtime(config.device)
    results.parent.mkdir(parents=True, exist_ok=True)
    pending = [key for key in config.runs() if key.id not in finished_runs(results)]
    if not pending:
        return []
    data = load_sites(config)  # also fills the data cache before any worker reads it
    if jobs > 1 and len(pending) > 1:
        _run_in_workers(config, results, pending, jobs, on_round, trackers)
        return pending
    for key in pending:
        attempt = uuid.uuid4().hex  # a resumed run rewrites its rounds under a new attempt
        started = time.perf_counter()
        tracking = RunTracking(trackers(key), config.study(key), run_params(key)) if trackers is not None else None
        final: TensorDict | None = None
        for record, theta in run_records(config, key, data, runtime):
            _write_round(results, key, {**record, "attempt": attempt}, tracking, on_round)
            final = theta
        seconds = time.perf_counter() - started
        _finish_run(results, key, attempt, seconds, tracking, dump(final) if final is not None else None)
    return pending


def run_records(
    config: ExperimentConfig, key: RunKey, data: dict[str, SiteData], runtime: Runtime
) -> Iterator[tuple[dict[str, Any], TensorDict]]:
    """One run of the grid: each round's record (without its attempt), with theta^g after the round."""
    study = config.study(key)
    n_classes = study.model.config().n_classes
    for outcome in simulate_study(study, data, runtime):
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


def _write_round(
    results: Path,
    key: RunKey,
    record: dict[str, Any],
    tracking: RunTracking | None,
    on_round: Callable[[RunKey, dict[str, Any]], None] | None,
) -> None:
    """A round's record to the results, the run's trackers and `on_round`."""
    _append(results, record)
    if tracking is not None:
        tracking.round(record)
    if on_round is not None:
        on_round(key, record)


def _finish_run(
    results: Path, key: RunKey, attempt: str, seconds: float, tracking: RunTracking | None, final: bytes | None
) -> None:
    """A finished run: theta^g_T to its trackers, and its `run_done` record."""
    if tracking is not None:
        tracking.finish(final, f"{run_slug(key)}-theta-g.safetensors")
    _append(results, {"type": "run_done", "run": key.id, "attempt": attempt, **key.model_dump(), "seconds": seconds})
    log.info("run %s finished in %.1fs", key.id, seconds)


_WORKER: dict[str, Any] = {}  # a worker process's experiment, sites' data and runtime


def _start_worker(config_json: str, threads: int) -> None:
    """A grid worker: the experiment read back, its sites' data (from the cache) and runtime, once."""
    torch.set_num_threads(threads)
    config = ExperimentConfig.model_validate_json(config_json)
    _WORKER.update(config=config, data=load_sites(config), runtime=resolve_runtime(config.device))


def _run_in_worker(key_json: str) -> tuple[list[dict[str, Any]], bytes | None, float]:
    """One run in a worker: its round records, theta^g_T as safetensors, and its seconds."""
    started = time.perf_counter()
    key = RunKey.model_validate_json(key_json)
    records: list[dict[str, Any]] = []
    final: TensorDict | None = None
    for record, theta in run_records(_WORKER["config"], key, _WORKER["data"], _WORKER["runtime"]):
        records.append(record)
        final = theta
    return records, dump(final) if final is not None else None, time.perf_counter() - started


def _run_in_workers(
    config: ExperimentConfig,
    results: Path,
    pending: list[RunKey],
    jobs: int,
    on_round: Callable[[RunKey, dict[str, Any]], None] | None,
    trackers: Callable[[RunKey], Sequence[Tracker]] | None,
) -> None:
    """`pending` in `jobs` worker processes; each run's records are written as it finishes."""
    threads = max(1, torch.get_num_threads() // jobs)
    context = multiprocessing.get_context("spawn")  # no forked torch state
    initargs = (config.model_dump_json(), threads)
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker, initargs=initargs) as pool:
        running = {pool.submit(_run_in_worker, key.model_dump_json()): key for key in pending}
        try:
            for future in as_completed(running):
                key = running[future]
                records, final, seconds = future.result()
                attempt = uuid.uuid4().hex
                tracking = (
                    RunTracking(trackers(key), config.study(key), run_params(key)) if trackers is not None else None
                )
                for record in records:
                    _write_round(results, key, {**record, "attempt": attempt}, tracking, on_round)
                _finish_run(results, key, attempt, seconds, tracking, final)
        except BaseException:
            for future in running:
                future.cancel()
            raise


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


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
