"""A grid of runs written to its results file: in this process, in worker processes, or on a Ray cluster.

`run_experiment` runs every (method, head split, seed) of an experiment not yet in its JSON-lines
results (cardiofl/experiment/runner.py simulates each), writing each round's record as it ends, or,
when the run went elsewhere (a worker process with --jobs, a Ray task with --backend ray), each
finished run's records at once. An interrupted experiment resumes with the first run not finished.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.progress import GridTally
from cardiofl.experiment.ray_backend import capacity, run_on_ray
from cardiofl.experiment.ray_common import absolute_paths, ray_session, task_threads, torch_threads
from cardiofl.experiment.ray_sites import RaySites
from cardiofl.experiment.runner import (
    FinishedRun,
    load_sites,
    run_params,
    run_records,
    run_slug,
    whole_run,
)
from cardiofl.experiment.site_rounds import SiteRounds
from cardiofl.tracking import RunTracking, Tracker
from shared.tensors.codec import TensorDict, dump
from site_agent.data import SiteData
from site_agent.device import Runtime, resolve_runtime

__all__ = ["GridFailed", "Placement", "finished_runs", "run_experiment"]

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Placement:
    """Where a grid's work goes: runs in this process, in `jobs` worker processes or as Ray tasks; sites too."""

    jobs: int = 1  # runs at a time in worker processes of this machine
    ray_address: str | None = None  # the Ray cluster of the runs and/or sites ("local": a Ray started for the call)
    runs_on_ray: bool = False  # each run a Ray task (--backend ray)
    sites_on_ray: bool = False  # each round's sites Ray tasks (--site-parallelism ray)

    def __post_init__(self) -> None:
        if (self.runs_on_ray or self.sites_on_ray) and self.ray_address is None:
            raise ValueError("work placed on Ray needs the cluster's address (or 'local')")
        if self.jobs > 1 and (self.runs_on_ray or self.sites_on_ray):
            raise ValueError("--jobs spreads runs over this machine's processes: on Ray the cluster's CPUs do")


class GridFailed(RuntimeError):
    """Runs of the grid that failed while the others were written; a rerun tries them again."""

    def __init__(self, failed: dict[str, BaseException]) -> None:
        self.failed = failed
        runs = ", ".join(failed)
        super().__init__(f"{len(failed)} run(s) failed: {runs} (the others are written; run again to retry these)")


def run_experiment(
    config: ExperimentConfig,
    results: Path,
    *,
    runtime: Runtime | None = None,
    on_round: Callable[[RunKey, dict[str, Any]], None] | None = None,
    trackers: Callable[[RunKey], Sequence[Tracker]] | None = None,
    placement: Placement | None = None,
    tally: GridTally | None = None,
) -> list[RunKey]:
    """Run every grid point not finished yet, appending records to `results`; returns the runs it ran.

    `trackers(key)` gives each run's experiment trackers (cardiofl.tracking: MLflow, TensorBoard):
    they get the run's key and terms, each round's scalars, and theta^g_T, as `cardiofl study track`
    logs a study of the same terms. With `placement.jobs` > 1 that many runs go at a time, each in a
    worker process of its own (the device's threads shared out between them); with `runs_on_ray` each
    run is a task on a Ray cluster (cardiofl/experiment/ray_backend.py). A run done elsewhere is
    written, and passed to `on_round` and the trackers, when it has finished; its records are those it
    would have alone with the same threads. With `sites_on_ray` each round's sites are Ray tasks
    (cardiofl/experiment/ray_sites.py). A run that fails is counted in `tally` and the others go on;
    GridFailed names the failed runs at the end.
    """
    placement = placement or Placement()
    runtime = runtime or resolve_runtime(config.device)
    results.parent.mkdir(parents=True, exist_ok=True)
    runs = config.runs()
    pending = [key for key in runs if key.id not in finished_runs(results)]
    if not pending:
        return []
    tally = tally or GridTally(len(runs), len(runs) - len(pending))
    data = load_sites(config)  # also fills the data cache before any worker reads it
    writer = _Writer(config, results, on_round, trackers, tally)
    if placement.ray_address is None:
        if placement.jobs > 1 and len(pending) > 1:
            _run_in_workers(config, writer, pending, placement.jobs)
        else:
            _run_here(config, data, writer, pending, runtime, None)
    else:
        with ray_session(placement.ray_address, tally.cluster) as ray:
            if placement.runs_on_ray:
                tally.slots = capacity(ray, config)
                for key, finished in run_on_ray(ray, config, pending, site_parallel=placement.sites_on_ray):
                    writer.ended(key, finished)
            else:  # the driver's own steps (server step, readings) at a site task's threads: the same records
                with torch_threads(task_threads(config)):
                    _run_here(config, data, writer, pending, runtime, RaySites(ray, absolute_paths(config)))
    if writer.failed:
        raise GridFailed(writer.failed)
    return pending


def _run_here(
    config: ExperimentConfig,
    data: dict[str, SiteData],
    writer: _Writer,
    pending: list[RunKey],
    runtime: Runtime,
    sites: SiteRounds | None,
) -> None:
    """`pending` one after another in this process, each round written as it ends."""
    writer.tally.slots = 1
    for key in pending:
        attempt = uuid.uuid4().hex  # a resumed run rewrites its rounds under a new attempt
        started = time.perf_counter()
        tracking = writer.tracking(key)
        final: TensorDict | None = None
        try:
            for record, theta in run_records(config, key, data, runtime, sites):
                writer.round(key, {**record, "attempt": attempt}, tracking)
                final = theta
        except Exception as error:  # noqa: BLE001 - the run is reported, the grid goes on
            writer.fail(key, error)
            continue
        writer.finish(key, attempt, time.perf_counter() - started, tracking, dump(final) if final is not None else None)


class _Writer:
    """Writes a grid's records to its results, its runs' trackers and `on_round`, and keeps its tally."""

    def __init__(
        self,
        config: ExperimentConfig,
        results: Path,
        on_round: Callable[[RunKey, dict[str, Any]], None] | None,
        trackers: Callable[[RunKey], Sequence[Tracker]] | None,
        tally: GridTally,
    ) -> None:
        self.config, self.results, self.on_round, self.trackers, self.tally = config, results, on_round, trackers, tally
        self.failed: dict[str, BaseException] = {}

    def tracking(self, key: RunKey) -> RunTracking | None:
        """The run's trackers, opened."""
        if self.trackers is None:
            return None
        return RunTracking(self.trackers(key), self.config.study(key), run_params(key))

    def round(self, key: RunKey, record: dict[str, Any], tracking: RunTracking | None) -> None:
        """A round's record to the results, the run's trackers and `on_round`."""
        _append(self.results, record)
        if tracking is not None:
            tracking.round(record)
        if self.on_round is not None:
            self.on_round(key, record)

    def finish(
        self, key: RunKey, attempt: str, seconds: float, tracking: RunTracking | None, final: bytes | None
    ) -> None:
        """A finished run: theta^g_T to its trackers, and its `run_done` record."""
        if tracking is not None:
            tracking.finish(final, f"{run_slug(key)}-theta-g.safetensors")
        record = {"type": "run_done", "run": key.id, "attempt": attempt, **key.model_dump(), "seconds": seconds}
        _append(self.results, record)
        self.tally.run_finished(key.id)
        log.info("run %s finished in %.1fs", key.id, seconds)

    def fail(self, key: RunKey, error: BaseException) -> None:
        """A run that failed: counted and said; nothing of it is marked done, so a rerun tries it again."""
        self.failed[key.id] = error
        self.tally.run_failed(key.id, error)
        log.error("run %s failed", key.id, exc_info=error)

    def ended(self, key: RunKey, outcome: FinishedRun | BaseException) -> None:
        """A run done elsewhere, written as the in-process runner writes its rounds, under a new attempt."""
        if isinstance(outcome, BaseException):
            self.fail(key, outcome)
            return
        records, final, seconds = outcome
        attempt = uuid.uuid4().hex
        tracking = self.tracking(key)
        for record in records:
            self.round(key, {**record, "attempt": attempt}, tracking)
        self.finish(key, attempt, seconds, tracking, final)


_WORKER: dict[str, Any] = {}  # a worker process's experiment, sites' data and runtime


def _start_worker(config_json: str, threads: int) -> None:
    """A grid worker: the experiment read back, its sites' data (from the cache) and runtime, once."""
    torch.set_num_threads(threads)
    config = ExperimentConfig.model_validate_json(config_json)
    _WORKER.update(config=config, data=load_sites(config), runtime=resolve_runtime(config.device))


def _run_in_worker(key_json: str) -> FinishedRun:
    """One run in a worker process."""
    key = RunKey.model_validate_json(key_json)
    return whole_run(_WORKER["config"], key, _WORKER["data"], _WORKER["runtime"])


def _run_in_workers(config: ExperimentConfig, writer: _Writer, pending: list[RunKey], jobs: int) -> None:
    """`pending` in `jobs` worker processes; each run's records are written as it finishes."""
    threads = max(1, torch.get_num_threads() // jobs)
    context = multiprocessing.get_context("spawn")  # no forked torch state
    initargs = (config.model_dump_json(), threads)
    writer.tally.slots = jobs
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker, initargs=initargs) as pool:
        running = {pool.submit(_run_in_worker, key.model_dump_json()): key for key in pending}
        try:
            for future in as_completed(running):
                error = future.exception()
                writer.ended(running[future], error if error is not None else future.result())
        except BaseException:
            for future in running:
                future.cancel()
            raise


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
