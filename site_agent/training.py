"""The local training loop: SGD steps over a site's batches, with hooks algorithms plug into."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from site_agent.device import Runtime

__all__ = ["Progress", "TrainResult", "TrainingInterrupted", "cycle_batches", "train_steps"]

log = logging.getLogger(__name__)

Batch = tuple[Tensor, Tensor]
LossTerm = Callable[[], Tensor]  # an extra loss on the current parameters (FedProx, Ditto)
GradHook = Callable[[], None]  # runs after backward, before the optimizer step (Scaffold)


class TrainingInterrupted(Exception):
    """Training stopped at a step boundary because the agent was asked to stop; nothing was uploaded."""


@dataclass(frozen=True)
class TrainResult:
    """What one local training run did."""

    steps: int
    samples: int
    loss: float  # mean BCE over the samples seen
    seconds: float

    @property
    def samples_per_second(self) -> float:
        """Throughput of the run."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Progress:
    """A progress bar on a terminal, a log line every `log_every_s` seconds otherwise."""

    def __init__(self, total: int, description: str, *, log_every_s: float = 30.0, bar: bool | None = None) -> None:
        self.total, self.description, self.log_every_s = total, description, log_every_s
        self._bar = None
        if bar if bar is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, unit="step", leave=False)
        self._start = self._last_log = time.monotonic()

    def due(self) -> bool:
        """Whether an update with a fresh loss value would be shown now (reading it costs a sync)."""
        return self._bar is not None or time.monotonic() - self._last_log >= self.log_every_s

    def update(self, step: int, samples: int, loss: float | None) -> None:
        """Report `step` steps done, `samples` samples seen, and the running loss if known."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "?", samples_s=f"{samples / elapsed:.0f}")
            return
        self._last_log = time.monotonic()
        log.info(
            "%s: step %d/%d, loss %s, %.1f samples/s",
            self.description,
            step,
            self.total,
            f"{loss:.4f}" if loss is not None else "?",
            samples / elapsed,
        )

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()


def cycle_batches(make_epoch: Callable[[], Iterable[Batch]]) -> Iterator[Batch]:
    """Endless batches: a new epoch (reshuffled by the caller's iterator) whenever one ends."""
    while True:
        empty = True
        for batch in make_epoch():
            empty = False
            yield batch
        if empty:
            raise ValueError("the training split has no batches")


def train_steps(
    model: nn.Module,
    batches: Iterator[Batch],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    runtime: Runtime,
    loss_terms: Iterable[LossTerm] = (),
    grad_hooks: Iterable[GradHook] = (),
    progress: Progress | None = None,
    stop: threading.Event | None = None,
) -> TrainResult:
    """Run `steps` optimizer steps of BCE-with-logits (plus `loss_terms`) on `batches`.

    Losses are accumulated on the device and read back only when progress is shown, so the loop
    adds no host synchronisation per step.
    """
    loss_terms, grad_hooks = tuple(loss_terms), tuple(grad_hooks)
    model.train()
    device = runtime.device
    loss_sum = torch.zeros((), device=device)
    samples = 0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        if stop is not None and stop.is_set():
            if progress is not None:
                progress.close()
            raise TrainingInterrupted(f"stopped after {step - 1} of {steps} steps")
        x, y = next(batches)
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with runtime.autocast():
            logits = model(x)
        loss = F.binary_cross_entropy_with_logits(logits.float(), y)
        total = loss
        for term in loss_terms:
            total = total + term()
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(total)  # total.backward(), which torch leaves unannotated
        for hook in grad_hooks:
            hook()
        optimizer.step()
        loss_sum += loss.detach() * x.shape[0]
        samples += x.shape[0]
        if progress is not None and (step == steps or progress.due()):
            progress.update(step, samples, float(loss_sum) / samples)
    if progress is not None:
        progress.close()
    seconds = time.perf_counter() - start
    return TrainResult(steps, samples, float(loss_sum) / max(samples, 1), seconds)
