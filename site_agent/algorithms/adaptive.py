"""Element-wise adaptive aggregation of own and received tensors (FedALA's ALA, FedAH's aggregated head).

mixed = own + (received - own) * W, with W in [0, 1] learned by gradient descent on the local loss:
W <- clamp(W - eta * dL/d(mixed) * (received - own), 0, 1), the received and own tensors frozen
(Zhang et al., FedALA, AAAI 2023; PFLlib `ALA.py`; FedAH `clientah.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.tensors.codec import TensorDict
from site_agent.algorithms.base import Batch
from site_agent.device import Runtime
from site_agent.training import TrainingInterrupted

__all__ = ["initial_weight", "learn_mix_weights", "mix"]


def mix(own: Tensor, received: Tensor, weight: Tensor) -> Tensor:
    """The mix own + (received - own) * W, exact at the ends: W = 1 gives `received`, W = 0 gives `own`."""
    return torch.lerp(own, received, weight)


def initial_weight(kept: Mapping[str, Tensor] | None, own: Mapping[str, Tensor], name: str) -> Tensor:
    """A fresh copy of the kept W of `name`, or ones (W starts at ones: the received tensor as is)."""
    return kept[name].clone() if kept is not None else torch.ones_like(own[name])


def learn_mix_weights(
    model: nn.Module,
    names: Sequence[str],
    own: Mapping[str, Tensor],
    received: Mapping[str, Tensor],
    weights: TensorDict,
    epoch: Callable[[], Iterator[Batch]],
    *,
    eta: float,
    done: Callable[[list[float]], bool],
    runtime: Runtime,
    stop: threading.Event | None = None,
    train_mode: bool = True,
) -> list[float]:
    """Learn `weights` (updated in place) and leave `model`'s `names` at mix(own, received, W).

    The model runs in train mode (batch statistics, dropout on) unless `train_mode` is False.
    Every other parameter is frozen meanwhile. Runs passes of `epoch()` until `done(losses)`,
    `losses` the mean loss of each pass so far, which is returned. All tensors must be on the
    model's device.
    """
    parameters = dict(model.named_parameters())
    targets = [parameters[name] for name in names]
    frozen = [p for p in model.parameters() if p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    for parameter in targets:
        parameter.requires_grad_(True)
    gaps = [received[name] - own[name] for name in names]
    _set_mixed(targets, names, own, received, weights)
    model.train(train_mode)
    losses: list[float] = []
    try:
        while True:
            total, count = torch.zeros((), device=runtime.device), 0
            for x, y in epoch():
                if stop is not None and stop.is_set():
                    raise TrainingInterrupted("stopped while learning aggregation weights")
                x, y = x.to(runtime.device, non_blocking=True), y.to(runtime.device, non_blocking=True)
                for parameter in targets:
                    parameter.grad = None
                with runtime.autocast():
                    logits = model(x)
                loss = F.binary_cross_entropy_with_logits(logits.float(), y)
                torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
                with torch.no_grad():
                    for parameter, name, gap in zip(targets, names, gaps, strict=True):
                        weight = weights[name]
                        weight.sub_(eta * parameter.grad * gap).clamp_(0.0, 1.0)  # type: ignore[operator]
                    _set_mixed(targets, names, own, received, weights)
                total += loss.detach() * x.shape[0]
                count += x.shape[0]
            if count == 0:
                raise ValueError("no batches to learn the aggregation weights on")
            losses.append(float(total) / count)
            if done(losses):
                return losses
    finally:
        for parameter in targets:
            parameter.grad = None
        for parameter in frozen:
            parameter.requires_grad_(True)


@torch.no_grad()
def _set_mixed(
    targets: Sequence[nn.Parameter],
    names: Sequence[str],
    own: Mapping[str, Tensor],
    received: Mapping[str, Tensor],
    weights: Mapping[str, Tensor],
) -> None:
    for parameter, name in zip(targets, names, strict=True):
        parameter.copy_(mix(own[name], received[name], weights[name]))
