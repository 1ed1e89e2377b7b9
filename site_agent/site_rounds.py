"""A site's round as a workflow: plain training, the final evaluation, or a secure round of either.

It mirrors the coordinator's workflows (coordinator/rounds/workflow.py, dispatch.py): `site_round_for`
chooses once, from the task's RoundKind and whether the terms ask for secure aggregation, and is the
one place that asks; the worker (site_agent/worker.py) runs what it returns. Each workflow computes
its result from the round's inputs and delivers it through the worker's `RoundHost` services: a
plain upload, or the secure round's first phase.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from shared.model.partition import Partition
from shared.tensors.codec import TensorDict
from shared.wire.protocol import RoundKind, TaskSpec
from site_agent.data import SiteData
from site_agent.device import Runtime
from site_agent.local_round import LocalRoundResult, LocalRoundSpec, run_local_evaluation, run_local_round
from site_agent.training import Progress

__all__ = ["Evaluation", "PlainTraining", "RoundHost", "RoundInputs", "SecureAggregated", "SiteRound", "site_round_for"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundInputs:
    """What a round computes from: the checked task, theta^g_{t-1}, phi_k (or phi_0) and the site's data."""

    task: TaskSpec
    spec: LocalRoundSpec
    study: str  # the site's key of the study (site_agent/approvals.py study_key)
    partition: Partition  # the study's theta^g / phi_k split of the model (its exchange's)
    global_tensors: TensorDict
    local_tensors: TensorDict
    initial_local: TensorDict
    data: SiteData
    runtime: Runtime
    progress: Callable[[int, str], Progress]
    stop: threading.Event | None = None


class RoundHost(Protocol):
    """The worker's services a round delivers through."""

    def send(self, inputs: RoundInputs, result: LocalRoundResult) -> int:
        """Store the pending update and upload it; the bytes sent."""
        ...

    def start_secure(self, inputs: RoundInputs, result: LocalRoundResult) -> None:
        """Advertise the secure round's keys; the worker's later polls take its phases."""
        ...

    def trained(self) -> None:
        """Count one round this site trained and had accepted."""
        ...


class SiteRound(ABC):
    """One kind of round at a site: what it computes, and how its result leaves."""

    kind: RoundKind
    secure: bool = False  # its upload leaves masked, after the secure round's phases

    @abstractmethod
    def compute(self, inputs: RoundInputs) -> LocalRoundResult:
        """The round's result: phi_k and the shared tensors trained, or the final model's statistics."""

    @abstractmethod
    def deliver(self, host: RoundHost, inputs: RoundInputs, result: LocalRoundResult) -> None:
        """Hand the result to the coordinator through `host`."""


class PlainTraining(SiteRound):
    """Train locally from theta^g_{t-1} and phi_k, upload the shared tensors and n_k."""

    kind = RoundKind.TRAIN

    def compute(self, inputs: RoundInputs) -> LocalRoundResult:
        """Train the round (site_agent/local_round.py)."""
        task = inputs.task
        log.info(
            "study %s round %d: training on %s (load factor %.2f)",
            task.study_id,
            task.round,
            inputs.runtime.describe(),
            inputs.spec.load_factor,
        )
        return run_local_round(
            inputs.spec,
            inputs.partition,
            global_tensors=inputs.global_tensors,
            local_tensors=inputs.local_tensors,
            initial_local=inputs.initial_local,
            data=inputs.data,
            runtime=inputs.runtime,
            progress=inputs.progress,
            stop=inputs.stop,
        )

    def deliver(self, host: RoundHost, inputs: RoundInputs, result: LocalRoundResult) -> None:
        """Upload the update."""
        sent = host.send(inputs, result)
        host.trained()
        meta = result.meta
        log.info(
            "study %s round %d: uploaded %d bytes (n_k=%d, loss %.4f, %.1f samples/s)",
            inputs.task.study_id,
            inputs.task.round,
            sent,
            meta.num_examples,
            meta.metrics.loss,
            getattr(meta.metrics, "samples_per_second", 0.0),
        )


class Evaluation(SiteRound):
    """Evaluate theta^g_T with phi_k on the site's test split; upload the statistics only."""

    kind = RoundKind.EVALUATE

    def compute(self, inputs: RoundInputs) -> LocalRoundResult:
        """The final model's statistics (site_agent/local_round.py)."""
        task = inputs.task
        log.info("study %s: evaluating the final global model of round %d", task.study_id, task.global_model_round)
        return run_local_evaluation(
            inputs.spec,
            global_tensors=inputs.global_tensors,
            local_tensors=inputs.local_tensors,
            initial_local=inputs.initial_local,
            data=inputs.data,
            runtime=inputs.runtime,
        )

    def deliver(self, host: RoundHost, inputs: RoundInputs, result: LocalRoundResult) -> None:
        """Upload the statistics."""
        host.send(inputs, result)
        log.info("study %s: final evaluation uploaded", inputs.task.study_id)


class SecureAggregated(SiteRound):
    """A round of either kind under secure aggregation: computed as its kind is, delivered through SecAgg+."""

    secure = True

    def __init__(self, inner: SiteRound) -> None:
        self.inner = inner
        self.kind = inner.kind

    def compute(self, inputs: RoundInputs) -> LocalRoundResult:
        """What the round's kind computes."""
        return self.inner.compute(inputs)

    def deliver(self, host: RoundHost, inputs: RoundInputs, result: LocalRoundResult) -> None:
        """Start the secure round: its masked upload leaves in a later phase."""
        host.start_secure(inputs, result)
        done = "trained" if self.kind is RoundKind.TRAIN else "evaluated the final global model"
        log.info(
            "study %s round %d: %s; keys advertised for secure aggregation",
            inputs.task.study_id,
            inputs.task.round,
            done,
        )


_BY_KIND: dict[RoundKind, SiteRound] = {RoundKind.TRAIN: PlainTraining(), RoundKind.EVALUATE: Evaluation()}


def site_round_for(task: TaskSpec) -> SiteRound:
    """The workflow of `task`: its kind's, under secure aggregation when the task's round is secure."""
    plain = _BY_KIND[task.kind]
    return SecureAggregated(plain) if task.secure is not None else plain
