"""The in-process runner: every site's round and the server's aggregation, with the service's own classes.

No HTTP and no database, but the same functions the coordinator and the site agents call: the
participation policy (shared.study.select_participants), a site's round
(site_agent.local_round.run_local_round, and run_local_evaluation for the final evaluation round),
the aggregation weights and the server update (shared.algorithms). Sites are visited in the
order the coordinator reads their updates (by name), so a run reproduces a study's theta^g bit for
bit on the CPU. Results go to a JSON-lines file as each round ends; an interrupted experiment
resumes with the first run that has not finished.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.server import aggregate_round
from shared.metrics import EvalStats
from shared.protocol import StudyConfig
from shared.study import initial_state, select_participants, study_partition
from shared.tensors import TensorDict
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.device import Runtime, resolve_runtime
from site_agent.local_round import LocalRoundResult, LocalRoundSpec, run_local_evaluation, run_local_round

__all__ = ["RoundOutcome", "finished_runs", "load_sites", "run_experiment", "simulate_study"]

log = logging.getLogger(__name__)


def _summary(stats: dict[str, Any] | None) -> dict[str, float | None] | None:
    if stats is None:
        return None
    return {k: (v if math.isfinite(v) else None) for k, v in EvalStats.from_dict(stats).summary().items()}


def _pooled(reports: list[dict[str, Any] | None]) -> dict[str, float | None] | None:
    present = [EvalStats.from_dict(r) for r in reports if r is not None]
    if not present:
        return None
    total = present[0]
    for stats in present[1:]:
        total = total + stats
    return {k: (v if math.isfinite(v) else None) for k, v in total.summary().items()}


@dataclass(frozen=True)
class RoundOutcome:
    """What one simulated round produced (round T+1 is the final evaluation: `global_model` is theta^g_T)."""

    round: int
    kind: str  # "train" or "evaluate"
    global_model: TensorDict  # theta^g_t after this round (unchanged by the evaluation round)
    results: dict[str, LocalRoundResult]  # by site
    weights: dict[str, float]

    def record(self) -> dict[str, Any]:
        """The JSON record of this round: per-site and pooled summaries, never tensors."""
        sites = {}
        for site, result in self.results.items():
            metrics = result.meta.metrics
            sites[site] = {
                "n": result.meta.num_examples,
                "weight": self.weights.get(site),
                "train_loss": metrics.loss if self.kind == "train" else None,
                "local": _summary(metrics.local_eval_stats),  # the site's personalised model
                "previous_global": _summary(metrics.eval_stats),  # theta^g_{t-1} with phi_0
            }
        total = sum(r.meta.num_examples for r in self.results.values())
        losses = [r.meta.num_examples * r.meta.metrics.loss for r in self.results.values()]
        return {
            "round": self.round,
            "kind": self.kind,
            "train_loss": sum(losses) / total if self.kind == "train" and total else None,
            "sites": sites,
            "local": _pooled([r.meta.metrics.local_eval_stats for r in self.results.values()]),
            "previous_global": _pooled([r.meta.metrics.eval_stats for r in self.results.values()]),
        }


def _spec(study: StudyConfig, number: int, site: str, load_factor: float = 1.0) -> LocalRoundSpec:
    """What a task of round `number` tells `site`, as the coordinator would send it."""
    return LocalRoundSpec(
        study.model,
        study.training,
        study.algorithm,
        study.seed,
        number,
        site,
        load_factor,
        aggregation=study.aggregation,
    )


def simulate_study(
    study: StudyConfig, data: dict[str, SiteData], runtime: Runtime, *, evaluate_final: bool = True
) -> Iterator[RoundOutcome]:
    """Run `study` as the coordinator and its agents would, yielding each round (and the final evaluation)."""
    partition = study_partition(study)
    theta, phi_0 = initial_state(study)
    private: dict[str, TensorDict] = {}  # each site's committed phi_k (and algorithm state)
    seconds: dict[str, float] = {}  # each site's last round time per unit of load (centre dropout)
    for number in range(1, study.rounds + 1):
        participants = select_participants(study, number, round_seconds=lambda: seconds)
        results: dict[str, LocalRoundResult] = {}
        for site in sorted(participants):
            spec = _spec(study, number, site, participants[site])
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
        theta, weights = aggregate_round(study, theta, [(site, results[site]) for site in sorted(results)])
        yield RoundOutcome(number, "train", theta, results, weights)
    if not evaluate_final:
        return
    final: dict[str, LocalRoundResult] = {}
    for site in sorted(study.sites):
        spec = _spec(study, study.rounds + 1, site)
        final[site] = run_local_evaluation(
            spec,
            global_tensors=theta,
            local_tensors=private.get(site, phi_0),
            initial_local=phi_0,
            data=data[site],
            runtime=runtime,
        )
    yield RoundOutcome(study.rounds + 1, "evaluate", theta, final, {})


def load_sites(config: ExperimentConfig) -> dict[str, SiteData]:
    """Each site's preprocessed data, from its folders or from the synthetic generator (cached)."""
    cache = Path(config.cache_dir)
    if config.sites:
        return {site.name: open_site_data(site.data, cache / site.name) for site in config.sites}
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
) -> list[RunKey]:
    """Run every grid point not finished yet, appending records to `results`; returns the runs it ran."""
    runtime = runtime or resolve_runtime(config.device)
    results.parent.mkdir(parents=True, exist_ok=True)
    pending = [key for key in config.runs() if key.id not in finished_runs(results)]
    if not pending:
        return []
    data = load_sites(config)
    for key in pending:
        attempt = uuid.uuid4().hex  # a resumed run rewrites its rounds under a new attempt
        started = time.perf_counter()
        study = config.study(key)
        for outcome in simulate_study(study, data, runtime):
            record = {"type": "round", "run": key.id, "attempt": attempt, **key.model_dump(), **outcome.record()}
            _append(results, record)
            if on_round is not None:
                on_round(key, record)
        seconds = time.perf_counter() - started
        _append(
            results, {"type": "run_done", "run": key.id, "attempt": attempt, **key.model_dump(), "seconds": seconds}
        )
        log.info("run %s finished in %.1fs", key.id, seconds)
    return pending


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
