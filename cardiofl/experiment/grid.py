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
from pathlib import Path
from typing import Any

import torch

from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.ray_backend import run_on_ray
from cardiofl.experiment.runner import FinishedRun, load_sites, run_params, run_records, run_slug, whole_run
from cardiofl.tracking import RunTracking, Tracker
from shared.tensors.codec import TensorDict, dump
from site_agent.device import Runtime, resolve_runtime

__all__ = ["finished_runs", "run_experiment", "write_finished_run"]

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


def run_experiment(
    config: ExperimentConfig,
    results: Path,
    *,
    runtime: Runtime | None = None,
    on_round: Callable[[RunKey, dict[str, Any]], None] | None = None,
    trackers: Callable[[RunKey], Sequence[Tracker]] | None = None,
    jobs: int = 1,
    ray_address: str | None = None,
) -> list[RunKey]:
    """Run every grid point not finished yet, appending records to `results`; returns the runs it ran.

    `trackers(key)` gives each run's experiment trackers (cardiofl.tracking: MLflow, TensorBoard):
    they get the run's key and terms, each round's scalars, and theta^g_T, as `cardiofl study track`
    logs a study of the same terms. With `jobs` > 1 that many runs go at a time, each in a worker
    process of its own (the device's threads shared out between them); a run's records are then
    written, and passed to `on_round` and the trackers, when it has finished, and every run's
    records are those it would have alone with a worker's threads (each resolves the experiment's device).
    With `ray_address` ("local": a Ray started for the call) each run is a task on that Ray cluster instead
    (cardiofl/experiment/ray_backend.py), written likewise as it finishes.
    """
    runtime = runtime or resolve_runtime(config.device)
    results.parent.mkdir(parents=True, exist_ok=True)
    pending = [key for key in config.runs() if key.id not in finished_runs(results)]
    if not pending:
        return []
    data = load_sites(config)  # also fills the data cache before any worker reads it
    if ray_address is not None:
        for key, finished in run_on_ray(config, pending, ray_address):
            write_finished_run(config, results, key, finished, on_round, trackers)
        return pending
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


def write_finished_run(
    config: ExperimentConfig,
    results: Path,
    key: RunKey,
    finished: FinishedRun,
    on_round: Callable[[RunKey, dict[str, Any]], None] | None,
    trackers: Callable[[RunKey], Sequence[Tracker]] | None,
) -> None:
    """A run done elsewhere, written as the in-process runner writes its rounds, under a new attempt."""
    records, final, seconds = finished
    attempt = uuid.uuid4().hex
    tracking = RunTracking(trackers(key), config.study(key), run_params(key)) if trackers is not None else None
    for record in records:
        _write_round(results, key, {**record, "attempt": attempt}, tracking, on_round)
    _finish_run(results, key, attempt, seconds, tracking, final)


def _run_in_worker(key_json: str) -> FinishedRun:
    """One run in a worker process."""
    key = RunKey.model_validate_json(key_json)
    return whole_run(_WORKER["config"], key, _WORKER["data"], _WORKER["runtime"])


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
                write_finished_run(config, results, running[future], future.result(), on_round, trackers)
        except BaseException:
            for future in running:
                future.cancel()
            raise


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
