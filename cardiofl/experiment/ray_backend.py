"""`cardiofl experiment run --backend ray`: each pending run of the grid a Ray task, on a cluster or a local Ray.

A task runs one whole run (runner.whole_run) and hands its round records and theta^g_T back to the driver,
which writes them as the local backends do, in the order the runs finish. What a task needs travels in
its arguments (cardiofl/experiment/ray_common.py): the experiment as JSON with its paths absolute, the
run's key (its seeds derive every random stream of the run), and its torch threads, the whole CPUs its
resources ask for. With site parallelism the run's sites go on as tasks of their own
(cardiofl/experiment/ray_sites.py). A task whose worker dies is retried by Ray (MAX_RETRIES) and, being
the same run from the same seeds, gives the same records. On a cluster of several machines the data
cache (`cache_dir`) must be on a file system they share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.ray_common import absolute_paths, task_threads, worker_experiment
from cardiofl.experiment.ray_sites import MAX_RETRIES, RaySites
from cardiofl.experiment.runner import FinishedRun, whole_run

__all__ = ["RUN_TASK", "capacity", "run_on_ray"]

RUN_TASK = "cardiofl-run"  # the tasks' name: Ray titles their worker processes "ray::cardiofl-run"


def capacity(ray: Any, config: ExperimentConfig) -> int:
    """How many of the experiment's tasks the cluster can run at once, by its CPUs and GPUs now (at least one)."""
    total = ray.cluster_resources()
    fits = [total.get("CPU", 0.0) / config.resources.num_cpus]
    if config.resources.num_gpus > 0:
        fits.append(total.get("GPU", 0.0) / config.resources.num_gpus)
    return max(1, int(min(fits)))


def run_on_ray(
    ray: Any, config: ExperimentConfig, pending: list[RunKey], *, site_parallel: bool = False
) -> Iterator[tuple[RunKey, FinishedRun | BaseException]]:
    """Each of `pending` as a task on the cluster `ray` is connected to: each as it finishes, or its error.

    A run that fails (after Ray's retries) comes back as its exception and the others go on; the tasks
    still running when the caller stops early (or fails) are cancelled.
    """
    task = ray.remote(_run_task).options(
        num_cpus=config.resources.num_cpus,
        num_gpus=config.resources.num_gpus,
        max_retries=MAX_RETRIES,
        name=RUN_TASK,
    )
    config_json = absolute_paths(config).model_dump_json()
    threads = task_threads(config)
    waiting = {task.remote(config_json, key.model_dump_json(), threads, site_parallel): key for key in pending}
    try:
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1)
            for ref in done:
                key = waiting.pop(ref)
                try:
                    yield key, ray.get(ref)
                except ray.exceptions.RayError as error:
                    yield key, error
    finally:
        for ref in waiting:
            ray.cancel(ref, force=True)


def _run_task(config_json: str, key_json: str, threads: int, site_parallel: bool) -> FinishedRun:
    """One run of the grid in a Ray worker, with `threads` torch threads (its sites as tasks if `site_parallel`)."""
    import ray
    import torch

    from site_agent.device import resolve_runtime

    torch.set_num_threads(threads)
    config, data = worker_experiment(config_json)
    sites = RaySites(ray, config) if site_parallel else None
    return whole_run(config, RunKey.model_validate_json(key_json), data, resolve_runtime(config.device), sites=sites)
