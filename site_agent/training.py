"""The local training loop: SGD steps over a site's batches, with hooks algorithms plug into.

Plain SGD (no momentum, no gradient hook) takes each parameter's step inside the backward pass, as
soon as its gradient is whole, and drops that gradient at once: the same arithmetic as
`optimizer.step()`, without ever holding the whole model's gradients (for a model of a gigabyte,
a gigabyte less at the peak).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from site_agent.device import Runtime

__all__ = ["Progress", "TrainResult", "TrainingInterrupted", "cycle_batches", "steps_in_backward", "train_steps"]

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
    in_backward = not grad_hooks and steps_in_backward(optimizer)
    with _StepsInBackward(optimizer) if in_backward else nullcontext():
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
            if not in_backward:  # else each parameter took its step as its gradient was complete
                for hook in grad_hooks:
                    hook()
                optimizer.step()
            loss_sum += loss.detach() * x.shape[0]
            samples += x.shape[0]
            if progress is not None and (step == steps or progress.due()):
                progress.update(step, samples, float(loss_sum) / samples)
    if progress is not None:
        progress.close()
    _slow_down(runtime, time.perf_counter() - start, stop)
    seconds = time.perf_counter() - start
    return TrainResult(steps, samples, float(loss_sum) / max(samples, 1), seconds)


def _slow_down(runtime: Runtime, seconds: float, stop: threading.Event | None) -> None:
    """Pause (slowdown - 1) times the training's `seconds` when the runtime says so; a stop request ends the pause."""
    pause = (runtime.slowdown - 1.0) * seconds
    if pause <= 0:
        return
    if stop is None:
        time.sleep(pause)
    elif stop.wait(pause):
        raise TrainingInterrupted(f"stopped while slowed down ({pause:.1f} s pause)")


def steps_in_backward(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is plain SGD (no momentum, not maximising), whose steps may be taken in the backward pass."""
    if type(optimizer) is not torch.optim.SGD:
        return False
    return all(
        group["momentum"] == 0 and not group.get("maximize", False) and not group.get("differentiable", False)
        for group in optimizer.param_groups
    )


class _StepsInBackward:
    """Inside: each parameter of a plain SGD optimizer steps as soon as its gradient is accumulated, then drops it.

    The update is SGD's own for one parameter, p - lr (g + weight_decay p); a parameter that got no
    gradient in a step does not move, as with `optimizer.step()`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> _StepsInBackward:
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.requires_grad:  # a frozen one never gets a gradient, nor a step
                    self.handles.append(parameter.register_post_accumulate_grad_hook(_sgd_step(group)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


def _sgd_step(group: dict[str, object]) -> Callable[[Tensor], None]:
    """The hook that takes one parameter's SGD step with `group`'s settings and frees its gradient."""

    @torch.no_grad()
    def step(parameter: Tensor) -> None:
        grad = parameter.grad
        if grad is None:
            return
        decay = float(group["weight_decay"])  # type: ignore[arg-type]
        if decay != 0:
            grad = grad.add(parameter, alpha=decay)
        parameter.add_(grad, alpha=-float(group["lr"]))  # type: ignore[arg-type]
        parameter.grad = None

    return step
