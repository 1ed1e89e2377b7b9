"""RaySites' traffic, through a stand-in for Ray that runs each task here: what goes to the object store, how often."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cardiofl.experiment.ray_common import absolute_paths, torch_threads
from cardiofl.experiment.ray_sites import RaySites
from cardiofl.experiment.runner import load_sites, simulate_study
from tests.cardiofl.experiment.test_runner import CPU, tiny_experiment


class InlineRay:
    """Ray's calls RaySites makes, done in this process; every put is counted, and only bytes may be put."""

    def __init__(self) -> None:
        self.puts: list[int] = []

    def put(self, value: bytes) -> bytes:
        assert isinstance(value, bytes)  # tensors travel as safetensors bytes, never pickled
        self.puts.append(len(value))
        return value

    def remote(self, function: Callable[..., Any]) -> InlineRay.Task:
        return InlineRay.Task(function)

    def get(self, refs: list[Any]) -> list[Any]:
        return refs

    class Task:
        def __init__(self, function: Callable[..., Any]) -> None:
            self.function = function

        def options(self, **_: Any) -> InlineRay.Task:
            return self

        def remote(self, *args: Any) -> Any:
            return self.function(*args)


def test_theta_goes_to_the_store_once_a_round_and_phi_0_once_a_run(tmp_path: Path) -> None:
    config = absolute_paths(tiny_experiment(tmp_path, privacy={"min_records": 3}))
    data = load_sites(config)
    study = config.study(config.runs()[0])
    ray = InlineRay()
    sites = RaySites(ray, config)
    with torch_threads(1):  # a task's threads, as the driver's
        in_turn = list(simulate_study(study, data, CPU))
        as_tasks = list(simulate_study(study, data, CPU, sites=sites))
        again = list(simulate_study(study, data, CPU, sites=sites))  # the next run of a grid
    # per run: theta^g before each of 2 training rounds and the final evaluation, and phi_0 once
    assert len(ray.puts) == 2 * (3 + 1)
    n_classes = study.model.config().n_classes
    for alone, packed, next_run in zip(in_turn, as_tasks, again, strict=True):
        assert all(torch.equal(alone.global_model[n], packed.global_model[n]) for n in alone.global_model)
        assert alone.record(n_classes) == packed.record(n_classes) == next_run.record(n_classes)
