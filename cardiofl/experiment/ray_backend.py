"""`cardiofl experiment run --backend ray`: each pending run of the grid a Ray task, on a cluster or a local Ray.

A task runs one whole run (runner.whole_run) and hands its round records and theta^g_T back to the driver,
which writes them as the local backends do, in the order the runs finish. What a task needs travels
in its arguments, never in the driver's state: the experiment as JSON with every path made absolute on the
driver (Ray's workers run in folders of their own, so `.cardiofl/experiments/cache` would name another
cache), the run's key (its seeds derive every random stream of the run: nothing seeded in the driver
is needed), and its torch threads, the whole CPUs its resources ask for. A task whose worker dies is
retried by Ray (MAX_RETRIES) and, being the same run from the same seeds, gives the same records.
On a cluster of several machines the data cache (`cache_dir`) must be on a file system they share.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cardiofl.experiment.config import ExperimentConfig, RunKey
from cardiofl.experiment.runner import FinishedRun, load_sites, whole_run

__all__ = ["INSTALL", "MAX_RETRIES", "RayMissing", "absolute_paths", "run_on_ray"]

log = logging.getLogger(__name__)

INSTALL = 'pip install "cardiofl[ray]"'
MAX_RETRIES = 3  # tries again of a run whose worker process or node died


class RayMissing(RuntimeError):
    """`--backend ray` without Ray installed."""


def _ray() -> Any:
    """The `ray` module, or RayMissing with the install command."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise RayMissing(f"--backend ray needs Ray: {INSTALL}") from None


def absolute_paths(config: ExperimentConfig, base: Path | None = None) -> ExperimentConfig:
    """`config` with its cache folder and every data source's paths absolute (against `base`, else the cwd)."""
    base = (base or Path.cwd()).resolve()

    def rooted(model: BaseModel) -> BaseModel:
        paths = {name: base / value for name, value in model if isinstance(value, Path) and not value.is_absolute()}
        return model.model_copy(update=paths)

    sites = [site.model_copy(update={"data": [rooted(source) for source in site.data]}) for site in config.sites]
    cache = config.cache_dir if config.cache_dir.is_absolute() else base / config.cache_dir
    return config.model_copy(update={"sites": sites, "cache_dir": cache})


def run_on_ray(config: ExperimentConfig, pending: list[RunKey], address: str) -> Iterator[tuple[RunKey, FinishedRun]]:
    """Each of `pending` as a task on the Ray cluster at `address` ("local": one started here): each as it finishes.

    A Ray this call started is shut down at the end; a cluster it joined is left running, and the tasks
    still running when the caller stops early (or fails) are cancelled.
    """
    ray = _ray()
    joined = ray.is_initialized()
    if not joined:
        context = ray.init(address=address, log_to_driver=False, configure_logging=False)
        if dashboard := getattr(context, "dashboard_url", None):
            log.info("Ray dashboard: http://%s", dashboard)
    resources = config.resources
    threads = max(1, int(resources.num_cpus))
    task = ray.remote(_run_task).options(
        num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, max_retries=MAX_RETRIES, name="cardiofl-run"
    )
    config_json = absolute_paths(config).model_dump_json()
    waiting = {task.remote(config_json, key.model_dump_json(), threads): key for key in pending}
    try:
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1)
            for ref in done:
                key = waiting.pop(ref)
                yield key, ray.get(ref)
    finally:
        for ref in waiting:
            ray.cancel(ref, force=True)
        if not joined:
            ray.shutdown()


def _run_task(config_json: str, key_json: str, threads: int) -> FinishedRun:
    """One run of the grid in a Ray worker, with `threads` torch threads."""
    import torch

    from site_agent.device import resolve_runtime

    torch.set_num_threads(threads)
    config, data = _experiment(config_json)
    return whole_run(config, RunKey.model_validate_json(key_json), data, resolve_runtime(config.device))


@functools.lru_cache(maxsize=1)
def _experiment(config_json: str) -> tuple[ExperimentConfig, dict[str, Any]]:
    """The experiment and its sites' data, read once by a worker for every run it is given."""
    config = ExperimentConfig.model_validate_json(config_json)
    return config, load_sites(config)
