import logging

import pytest
import torch

from shared.model.network import build_model, preset
from site_agent.device import resolve_runtime
from site_agent.training import Progress, cycle_batches, train_steps


def toy_batches(seed: int = 0, n: int = 64, batch: int = 16):
    """Class 0 is positive exactly when lead I carries a large offset: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, 5000, generator=g) * 0.1
    y = torch.zeros(n, 20)
    positive = torch.arange(n) % 2 == 0
    x[positive, 0] += 2.0
    y[positive, 0] = 1.0

    def epoch():
        order = torch.randperm(n, generator=g)
        for i in range(0, n, batch):
            idx = order[i : i + batch]
            yield x[idx], y[idx]

    return cycle_batches(epoch)


def test_training_reduces_loss_and_counts_steps() -> None:
    torch.manual_seed(0)
    model = build_model(preset("tiny", "6:2"), seed=0)
    runtime = resolve_runtime("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = toy_batches()
    first = train_steps(model, batches, optimizer, steps=4, runtime=runtime)
    for _ in range(4):
        last = train_steps(model, batches, optimizer, steps=4, runtime=runtime)
    assert first.steps == 4 and first.samples == 64
    assert last.loss < first.loss * 0.7
    assert first.samples_per_second > 0


def test_loss_terms_and_grad_hooks_take_part() -> None:
    model = build_model(preset("tiny", "8:0"), seed=0)
    runtime = resolve_runtime("cpu")
    calls: list[int] = []
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}

    def pull_back() -> torch.Tensor:
        return 1e6 * sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())

    def zero_head_grad() -> None:
        calls.append(1)
        model.head.weight.grad.zero_()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    head_before = model.head.weight.detach().clone()
    train_steps(
        model, toy_batches(), optimizer, steps=3, runtime=runtime, loss_terms=[pull_back], grad_hooks=[zero_head_grad]
    )
    assert len(calls) == 3
    assert torch.equal(model.head.weight.detach(), head_before)


def test_cycle_batches_refuses_an_empty_split() -> None:
    with pytest.raises(ValueError, match="no batches"):
        next(cycle_batches(lambda: iter(())))


def test_progress_logs_when_not_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    model = build_model(preset("tiny"), seed=0)
    progress = Progress(2, "round 1", log_every_s=0.0, bar=False)
    with caplog.at_level(logging.INFO, logger="site_agent.training"):
        train_steps(
            model,
            toy_batches(),
            torch.optim.SGD(model.parameters(), lr=0.01),
            steps=2,
            runtime=resolve_runtime("cpu"),
            progress=progress,
        )
    assert "round 1: step 2/2" in caplog.text and "samples/s" in caplog.text


def test_runtime_resolution() -> None:
    assert resolve_runtime("cpu").device.type == "cpu"
    auto = resolve_runtime("auto")
    assert auto.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_runtime("cuda")
    with pytest.raises(ValueError):
        resolve_runtime("tpu")
