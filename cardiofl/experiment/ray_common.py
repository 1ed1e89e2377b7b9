"""What the grid's and the sites' Ray tasks share: the module, the session, paths, and a worker's experiment.

Everything a task needs travels in its arguments, never in the driver's state: the experiment as JSON with
every path made absolute on the driver (Ray's workers run in folders of their own, so
`.cardiofl/experiments/cache` would name another cache), keys and terms as JSON, tensors as safetensors
bytes. Every random stream of a run derives from its seeds, so nothing seeded in the driver is needed.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.runner import load_sites
from site_agent.data import SiteData

__all__ = [
    "INSTALL",
    "RayMissing",
    "absolute_paths",
    "ray_module",
    "ray_session",
    "task_threads",
    "torch_threads",
    "worker_experiment",
]

log = logging.getLogger(__name__)

INSTALL = 'pip install "cardiofl[ray]"'


class RayMissing(RuntimeError):
    """Ray asked for (`--backend ray`, `--site-parallelism ray`) without Ray installed."""


def ray_module() -> Any:
    """The `ray` module, or RayMissing with the install command."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise RayMissing(f"Ray is not installed: {INSTALL}") from None


@contextmanager
def ray_session(address: str, on_dashboard: Callable[[str], None] | None = None) -> Iterator[Any]:
    """The `ray` module connected to the cluster at `address` ("local": one started here) inside.

    A Ray this call started is shut down at the end; one already connected (inside a Ray task) is left as it is.
    `on_dashboard` gets the cluster's dashboard address, where it has one.
    """
    ray = ray_module()
    if ray.is_initialized():
        yield ray
        return
    context = ray.init(address=address, log_to_driver=False, configure_logging=False)
    dashboard = getattr(context, "dashboard_url", None)
    if dashboard:
        log.info("Ray dashboard: http://%s", dashboard)
        if on_dashboard is not None:
            on_dashboard(f"http://{dashboard}")
    try:
        yield ray
    finally:
        ray.shutdown()


def task_threads(config: ExperimentConfig) -> int:
    """A task's torch threads: the whole CPUs its resources ask for (at least one)."""
    return max(1, int(config.resources.num_cpus))


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch threads of the process set to `threads` inside (sums over threads round their own way)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def absolute_paths(config: ExperimentConfig, base: Path | None = None) -> ExperimentConfig:
    """`config` with its cache folder and every data source's paths absolute (against `base`, else the cwd)."""
    base = (base or Path.cwd()).resolve()

    def rooted(model: BaseModel) -> BaseModel:
        paths = {name: base / value for name, value in model if isinstance(value, Path) and not value.is_absolute()}
        return model.model_copy(update=paths)

    sites = [site.model_copy(update={"data": [rooted(source) for source in site.data]}) for site in config.sites]
    cache = config.cache_dir if config.cache_dir.is_absolute() else base / config.cache_dir
    return config.model_copy(update={"sites": sites, "cache_dir": cache})


@functools.lru_cache(maxsize=1)
def worker_experiment(config_json: str) -> tuple[ExperimentConfig, dict[str, SiteData]]:
    """The experiment and its sites' data, read once by a worker for every task it is given."""
    config = ExperimentConfig.model_validate_json(config_json)
    return config, load_sites(config)
