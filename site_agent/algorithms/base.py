"""What every client algorithm builds on: a round's context and outcome, seeded batches, training phases.

Algorithms see tensors and data only (no HTTP, no store), so the site agent and the in-process
experiment runner run exactly the same code. Every random stream of a round derives from the
round's seed: the main training phase draws its batches from a generator seeded with it, any
other phase (`phase="head"` ...) from a generator seeded with (seed, phase).
"""

from __future__ import annotations

import hashlib
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel
from torch import Tensor, nn

from shared.algorithms.exchange import Exchange
from shared.model.network import ModelConfig, build_model, load_released
from shared.tensors.codec import TensorDict
from shared.terms import TrainingConfig
from site_agent.data import SiteData, SplitArrays, iterate_batches
from site_agent.device import Runtime
from site_agent.training import Progress, TrainResult, cycle_batches, train_steps

__all__ = [
    "Batch",
    "ClientAlgorithm",
    "GradHook",
    "LossTerm",
    "RoundContext",
    "RoundOutcome",
    "combined",
    "detached",
    "make_optimizer",
    "stable_seed",
    "batches_per_epoch",
    "steps_for",
]

Batch = tuple[Tensor, Tensor]
LossTerm = Callable[[], Tensor]
GradHook = Callable[[], None]


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, the same in every process and on every machine."""
    digest = hashlib.sha256("|".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def batches_per_epoch(n_records: int, training: TrainingConfig) -> int:
    """Batches of one pass over `n_records` (the last may be short), capped by max_steps."""
    per_epoch = math.ceil(n_records / training.batch_size)
    return per_epoch if training.max_steps is None else min(per_epoch, training.max_steps)


def steps_for(n_train: int, training: TrainingConfig, load_factor: float) -> int:
    """Optimizer steps of a round: epochs x batches per epoch, scaled by the load factor."""
    return max(1, math.ceil(load_factor * training.local_epochs * batches_per_epoch(n_train, training)))


def make_optimizer(parameters: nn.Module | Iterable[nn.Parameter], training: TrainingConfig) -> torch.optim.Optimizer:
    """A fresh optimizer over a model's parameters (or the given ones); no optimizer state outlives a phase."""
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    if training.optimizer == "adam":
        return torch.optim.Adam(params, lr=training.lr, weight_decay=training.weight_decay)
    return torch.optim.SGD(params, lr=training.lr, momentum=training.momentum, weight_decay=training.weight_decay)


def detached(tensors: Mapping[str, Tensor], prefix: str = "") -> TensorDict:
    """CPU copies of `tensors`, their names prefixed: what an algorithm keeps or uploads."""
    return {prefix + name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


def combined(*results: TrainResult) -> TrainResult:
    """Several training phases as one: steps, samples and time add up; the loss is per sample."""
    samples = sum(r.samples for r in results)
    loss = math.fsum(r.loss * r.samples for r in results) / max(samples, 1)
    return TrainResult(sum(r.steps for r in results), samples, loss, sum(r.seconds for r in results))


@dataclass(frozen=True)
class RoundContext:
    """One site's round as an algorithm sees it: the tensors it starts from, its data, how to train."""

    config: ModelConfig
    model_seed: int  # the study's seed: models are built from it, then loaded with the round's tensors
    training: TrainingConfig
    params: BaseModel  # the algorithm's own parameters
    exchange: Exchange
    load_factor: float  # scales the round's main training phase
    seed: int  # the site's round seed
    received: TensorDict  # theta^g_{t-1}: the shared model tensors
    server_state: TensorDict  # extra tensors of the global model blob (Scaffold's c)
    own: TensorDict  # phi_k: the model's local tensors
    state: TensorDict  # the algorithm's private tensors from earlier rounds; empty at first
    data: SiteData
    runtime: Runtime
    label: str = ""  # e.g. "lyon round 3", for progress bars
    progress: Callable[[int, str], Progress] | None = None
    stop: threading.Event | None = field(default=None, compare=False)

    def start_state(self) -> TensorDict:
        """theta^g_{t-1} with phi_k: the model every algorithm starts its round from."""
        return {**self.received, **self.own}

    def build(self, state: Mapping[str, Tensor]) -> nn.Module:
        """The model holding `state` (every model name, nothing else), on the round's device."""
        model = build_model(self.config, seed=self.model_seed)
        return load_released(model, state).to(self.runtime.device)

    def kept(self, prefix: str, names: Iterable[str]) -> TensorDict | None:
        """The kept tensors `prefix + name` by model name; None before the algorithm first kept them."""
        names = tuple(names)
        present = [name for name in names if prefix + name in self.state]
        if not present:
            return None
        if len(present) != len(names):
            raise ValueError(f"the site keeps only {len(present)} of the {len(names)} {prefix}* tensors")
        return {name: self.state[prefix + name] for name in names}

    def generator(self, phase: str = "") -> torch.Generator:
        """The random stream of one phase of the round."""
        return torch.Generator().manual_seed(self.seed if not phase else stable_seed(self.seed, phase))

    def epoch(
        self, phase: str, *, split: SplitArrays | None = None, shuffle: bool = True, drop_last: bool = False
    ) -> Callable[[], Iterator[Batch]]:
        """One pass over `split` (the training split), at most `max_steps` batches; call again for the next.

        `drop_last` drops a last short batch (PFLlib's loaders) unless the split is smaller than one batch.
        """
        split = split if split is not None else self.data.train
        generator = self.generator(phase)
        size = self.training.batch_size
        limit = self.training.max_steps * size if self.training.max_steps is not None else None
        drop = drop_last and len(split) >= size
        return lambda: iterate_batches(
            split, size, shuffle=shuffle, generator=generator, drop_last=drop, limit_samples=limit
        )

    def round_steps(self) -> int:
        """Steps of the round's main phase: local_epochs, scaled by the load factor."""
        return steps_for(len(self.data.train), self.training, self.load_factor)

    def epoch_steps(self, epochs: int) -> int:
        """Steps of `epochs` passes over the training split (not scaled by the load factor)."""
        return steps_for(len(self.data.train), self.training.model_copy(update={"local_epochs": epochs}), 1.0)

    def train(
        self,
        model: nn.Module,
        steps: int,
        *,
        trainable: Iterable[str] | None = None,
        loss_terms: Iterable[LossTerm] = (),
        grad_hooks: Iterable[GradHook] = (),
        phase: str = "",
        batches: Iterator[Batch] | None = None,
    ) -> TrainResult:
        """Train `model` for `steps` steps with a fresh optimizer; only the parameters `trainable` (default all).

        `batches`, when given, replaces the epochs of the training split.
        """
        names = set(trainable) if trainable is not None else None
        frozen = [p for n, p in model.named_parameters() if names is not None and n not in names and p.requires_grad]
        for parameter in frozen:
            parameter.requires_grad_(False)
        try:
            optimizer = make_optimizer((p for p in model.parameters() if p.requires_grad), self.training)
            description = f"{self.label} {phase}".strip()
            bar = self.progress(steps, description) if self.progress is not None else None
            epochs = self.epoch(phase)
            return train_steps(
                model,
                cycle_batches(epochs) if batches is None else batches,
                optimizer,
                steps=steps,
                runtime=self.runtime,
                loss_terms=loss_terms,
                grad_hooks=grad_hooks,
                progress=bar,
                stop=self.stop,
            )
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)


@dataclass(frozen=True)
class RoundOutcome:
    """What an algorithm's round produced."""

    model: nn.Module  # trained: its shared tensors are uploaded, its phi_k names kept
    training: TrainResult  # every training phase of the round together
    personal: nn.Module | None = None  # the model the site evaluates as its own (default: `model`)
    state: TensorDict = field(default_factory=dict)  # the algorithm's private tensors to keep (CPU)
    uploads: TensorDict = field(default_factory=dict)  # the algorithm's extra tensors to upload (CPU)


class ClientAlgorithm(ABC):
    """A client algorithm: one round of local work, and the model a site evaluates as its own."""

    @abstractmethod
    def run(self, ctx: RoundContext) -> RoundOutcome:
        """Train for one round from `ctx`."""

    def personal_model(self, ctx: RoundContext) -> nn.Module:
        """The site's own model for the final evaluation of theta^g_T: theta^g_T with phi_k by default."""
        return ctx.build(ctx.start_state())
