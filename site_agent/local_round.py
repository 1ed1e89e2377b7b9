"""One site's part of one round, with no HTTP: load theta^g and phi_k, train, evaluate, split what to send.

The site agent calls this with what it downloaded; the in-process experiment runner calls it with
tensors in memory. Both therefore train exactly the same way, down to the random stream, which
is derived from (study seed, round, site) alone.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from shared.metrics import EvalStats
from shared.model import build_model
from shared.partition import Partition
from shared.protocol import AlgorithmSpec, ModelSpec, TrainingConfig, UpdateMeta, UpdateMetrics
from shared.tensors import TensorDict
from site_agent.data import SiteData, SplitArrays, iterate_batches
from site_agent.device import Runtime
from site_agent.training import Progress, cycle_batches, train_steps

__all__ = [
    "LocalRoundResult",
    "LocalRoundSpec",
    "evaluate",
    "make_optimizer",
    "round_seed",
    "run_local_evaluation",
    "run_local_round",
    "steps_for",
]


@dataclass(frozen=True)
class LocalRoundSpec:
    """Everything that decides how a site trains in one round."""

    model: ModelSpec
    training: TrainingConfig
    algorithm: AlgorithmSpec
    seed: int  # the study's seed
    round: int
    site: str
    load_factor: float = 1.0


@dataclass(frozen=True)
class LocalRoundResult:
    """What a round produced: tensors to upload, private tensors to keep, and the update's meta."""

    shared: TensorDict  # exactly the study's shared names
    local: TensorDict  # phi_k after training; never leaves the site
    meta: UpdateMeta


def round_seed(study_seed: int, round_: int, site: str) -> int:
    """A 63-bit seed for one site's round, stable across processes and machines."""
    digest = hashlib.sha256(f"cardiofl|{study_seed}|{round_}|{site}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_optimizer(model: nn.Module, training: TrainingConfig) -> torch.optim.Optimizer:
    """The round's optimizer over every parameter (theta^g and phi_k are trained jointly)."""
    if training.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=training.lr, weight_decay=training.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=training.lr, momentum=training.momentum, weight_decay=training.weight_decay
    )


def steps_for(n_train: int, training: TrainingConfig, load_factor: float) -> int:
    """Optimizer steps of a round: epochs x batches per epoch (capped by max_steps), scaled by the load factor."""
    per_epoch = math.ceil(n_train / training.batch_size)
    if training.max_steps is not None:
        per_epoch = min(per_epoch, training.max_steps)
    return max(1, math.ceil(load_factor * training.local_epochs * per_epoch))


@torch.no_grad()
def evaluate(model: nn.Module, split: SplitArrays, runtime: Runtime, *, batch_size: int = 64) -> EvalStats:
    """Sufficient statistics of `model` on `split`; per-sample scores never leave this function."""
    model.eval()
    stats = EvalStats.empty(model.head.out_features)  # type: ignore[union-attr, arg-type]
    for x, y in iterate_batches(split, batch_size, shuffle=False):
        with runtime.autocast():
            logits = model(x.to(runtime.device, non_blocking=True)).float()
        y = y.to(runtime.device)
        per_sample = nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(dim=1)
        scores = torch.sigmoid(logits)
        stats = stats + EvalStats.from_predictions(
            y.cpu().numpy(), scores.cpu().numpy(), loss_sum=float(per_sample.sum())
        )
    return stats


def _model_with(spec: LocalRoundSpec, runtime: Runtime, *parts: Mapping[str, Tensor]) -> nn.Module:
    model = build_model(spec.model.config(), seed=spec.seed)
    state: dict[str, Tensor] = {}
    for part in parts:
        state.update(part)
    model.load_state_dict(state, strict=True)
    return model.to(runtime.device)


def run_local_round(
    spec: LocalRoundSpec,
    partition: Partition,
    *,
    global_tensors: Mapping[str, Tensor],
    local_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    data: SiteData,
    runtime: Runtime,
    progress: Callable[[int, str], Progress] | None = None,
    stop: threading.Event | None = None,
) -> LocalRoundResult:
    """Train from theta^g_{t-1} and phi_k, evaluate, and return (shared, local, meta).

    `eval_stats` describe the global evaluation model theta^g_{t-1} with phi_0 (DESIGN §3) on the
    site's test split; `local_eval_stats` the site's personalised model after training.
    """
    if len(data.train) == 0:
        raise ValueError(f"site {spec.site} has no training records")
    seed = round_seed(spec.seed, spec.round, spec.site)
    cuda_devices = [runtime.device.index or 0] if runtime.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        global_model = _model_with(spec, runtime, global_tensors, initial_local)
        global_stats = evaluate(global_model, data.test, runtime) if len(data.test) else None
        del global_model

        model = _model_with(spec, runtime, global_tensors, local_tensors)
        optimizer = make_optimizer(model, spec.training)
        generator = torch.Generator().manual_seed(seed)
        batches: Iterator[tuple[Tensor, Tensor]] = cycle_batches(
            lambda: iterate_batches(data.train, spec.training.batch_size, shuffle=True, generator=generator)
        )
        steps = steps_for(len(data.train), spec.training, spec.load_factor)
        bar = progress(steps, f"{spec.site} round {spec.round}") if progress is not None else None
        result = train_steps(model, batches, optimizer, steps=steps, runtime=runtime, progress=bar, stop=stop)
        local_stats = evaluate(model, data.test, runtime) if len(data.test) else None

    state = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
    shared, local = partition.split(state)
    metrics = UpdateMetrics(
        loss=result.loss,
        eval_stats=global_stats.to_dict() if global_stats is not None else None,
        local_eval_stats=local_stats.to_dict() if local_stats is not None else None,
        train_steps=result.steps,
        samples_per_second=result.samples_per_second,
    )
    meta = UpdateMeta(num_examples=len(data.train), metrics=metrics, train_seconds=result.seconds)
    return LocalRoundResult(shared, local, meta)


def run_local_evaluation(
    spec: LocalRoundSpec,
    *,
    global_tensors: Mapping[str, Tensor],
    local_tensors: Mapping[str, Tensor],
    initial_local: Mapping[str, Tensor],
    data: SiteData,
    runtime: Runtime,
) -> LocalRoundResult:
    """The final evaluation round: statistics of theta^g_T with phi_0 and with phi_k; nothing to upload but them."""
    if len(data.test) == 0:
        raise ValueError(f"site {spec.site} has no test records to evaluate on")
    global_stats = evaluate(_model_with(spec, runtime, global_tensors, initial_local), data.test, runtime)
    local_stats = evaluate(_model_with(spec, runtime, global_tensors, local_tensors), data.test, runtime)
    metrics = UpdateMetrics(
        loss=global_stats.loss_sum / global_stats.n_samples,
        eval_stats=global_stats.to_dict(),
        local_eval_stats=local_stats.to_dict(),
    )
    meta = UpdateMeta(num_examples=len(data.train), metrics=metrics, train_seconds=0.0)
    return LocalRoundResult({}, dict(local_tensors), meta)
