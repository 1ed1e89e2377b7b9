"""`--site-parallelism ray`: each round's sites as Ray tasks, the server step in the driver as before.

theta^g_{t-1} goes to the object store once a round (safetensors bytes, as phi_0 once a run) and every
site's task reads it there; each site's kept tensors (phi_k and its algorithm's state) stay with the
driver between rounds, as the in-process runner keeps them, and travel with its task. A task runs
site_rounds.site_round, the sequential runner's own function, with the torch threads its resources ask
for: theta^g is the sequential runner's bit for bit at the same threads per site. A task whose worker
dies is run again (MAX_RETRIES): the same round from the same seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.ray_common import task_threads, worker_experiment
from cardiofl.experiment.site_rounds import Kept, site_round
from shared.tensors.codec import TensorDict, dump, load
from shared.terms import StudyTerms
from shared.wire.protocol import UpdateMeta
from site_agent.local_round import LocalRoundResult

__all__ = ["MAX_RETRIES", "RaySites", "SITE_TASK"]

MAX_RETRIES = 3  # tries again of a task whose worker process or node died
SITE_TASK = "cardiofl-site"  # the tasks' name: Ray titles their worker processes "ray::cardiofl-site"

# A site's round as it comes back: shared tensors, kept tensors, the update's meta (JSON), DP grid changes
PackedResult = tuple[bytes, bytes, str, bytes]


class RaySites:
    """The sites of a round as Ray tasks on the cluster `ray` is connected to (site_rounds.SiteRounds)."""

    def __init__(self, ray: Any, config: ExperimentConfig) -> None:
        self._ray = ray
        self._config_json = config.model_dump_json()  # paths already absolute (ray_common.absolute_paths)
        self._threads = task_threads(config)
        self._phi_0: tuple[TensorDict, Any] | None = None  # a run's phi_0 and its reference in the object store
        self._task = ray.remote(_site_task).options(
            num_cpus=config.resources.num_cpus,
            num_gpus=config.resources.num_gpus,
            max_retries=MAX_RETRIES,
            name=SITE_TASK,
        )

    def train(
        self, study: StudyTerms, number: int, participants: Sequence[str], theta: TensorDict, kept: Kept
    ) -> dict[str, LocalRoundResult]:
        """Each kept site's round among `participants`, all at once as the cluster's CPUs allow."""
        return self._run(study, number, sorted(kept[0]), list(participants), theta, kept)

    def evaluate(self, study: StudyTerms, number: int, theta: TensorDict, kept: Kept) -> dict[str, LocalRoundResult]:
        """Every site's final evaluation, all at once."""
        return self._run(study, number, sorted(study.sites), None, theta, kept)

    def _run(
        self,
        study: StudyTerms,
        number: int,
        sites: list[str],
        participants: list[str] | None,
        theta: TensorDict,
        kept: Kept,
    ) -> dict[str, LocalRoundResult]:
        tensors, phi_0 = kept
        if self._phi_0 is None or self._phi_0[0] is not phi_0:  # once a run: phi_0 does not change within it
            self._phi_0 = (phi_0, self._ray.put(dump(phi_0)))
        theta_ref, phi_0_ref = self._ray.put(dump(theta)), self._phi_0[1]
        terms = study.model_dump_json()
        refs = [
            self._task.remote(
                self._config_json,
                terms,
                site,
                number,
                participants,
                theta_ref,
                phi_0_ref if tensors[site] is phi_0 else dump(tensors[site]),
                phi_0_ref,
                self._threads,
            )
            for site in sites
        ]
        try:
            packed = self._ray.get(refs)
        except BaseException:
            for ref in refs:
                self._ray.cancel(ref, force=True)
            raise
        return {site: unpack(result) for site, result in zip(sites, packed, strict=True)}


def pack(result: LocalRoundResult) -> PackedResult:
    """A site's round as bytes and JSON: tensors as safetensors, the grid's int64 arrays likewise."""
    grid = {name: torch.from_numpy(values) for name, values in result.grid.items()}
    return dump(result.shared), dump(result.local), result.meta.model_dump_json(), dump(grid)


def unpack(packed: PackedResult) -> LocalRoundResult:
    """`pack`'s result read back."""
    shared, local, meta, grid = packed
    arrays = {name: tensor.numpy() for name, tensor in load(grid)[0].items()}
    return LocalRoundResult(load(shared)[0], load(local)[0], UpdateMeta.model_validate_json(meta), arrays)


def _site_task(
    config_json: str,
    terms_json: str,
    site: str,
    number: int,
    participants: list[str] | None,
    theta: bytes,
    kept: bytes,
    initial_local: bytes,
    threads: int,
) -> PackedResult:
    """One site's round in a Ray worker, with `threads` torch threads."""
    from site_agent.device import resolve_runtime

    torch.set_num_threads(threads)
    config, data = worker_experiment(config_json)
    study = StudyTerms.model_validate_json(terms_json)
    runtime = resolve_runtime(config.device)
    received, own, phi_0 = (load(blob)[0] for blob in (theta, kept, initial_local))
    return pack(site_round(study, site, number, participants, received, own, phi_0, data[site], runtime))
