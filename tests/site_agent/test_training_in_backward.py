"""Plain SGD's steps taken in the backward pass give the same parameters as `optimizer.step()`, and hold no gradient."""

import pytest
import torch

from shared.model.network import build_model, preset
from site_agent.device import resolve_runtime
from site_agent.training import steps_in_backward, train_steps
from tests.site_agent.test_training import toy_batches


class _StepAfterBackward(torch.optim.SGD):
    """SGD as torch steps it, after the whole backward pass (a subclass: never stepped in the backward pass)."""


def trained(optimizer_type: type[torch.optim.SGD], **settings: float) -> tuple[dict[str, torch.Tensor], bool]:
    torch.manual_seed(0)  # dropout's draws
    model = build_model(preset("tiny", "6:2"), seed=0)
    optimizer = optimizer_type(model.parameters(), lr=0.1, **settings)
    train_steps(model, toy_batches(), optimizer, steps=3, runtime=resolve_runtime("cpu"))
    held = any(parameter.grad is not None for parameter in model.parameters())
    return {name: t.detach().clone() for name, t in model.state_dict().items()}, held


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_steps_in_the_backward_pass_equal_steps_after_it_and_leave_no_gradient(weight_decay: float) -> None:
    fused, fused_held = trained(torch.optim.SGD, weight_decay=weight_decay)
    plain, plain_held = trained(_StepAfterBackward, weight_decay=weight_decay)
    assert fused.keys() == plain.keys() and all(torch.equal(fused[name], plain[name]) for name in fused)
    assert plain_held and not fused_held


def test_only_plain_sgd_steps_in_the_backward_pass() -> None:
    parameters = [torch.nn.Parameter(torch.zeros(2))]
    assert steps_in_backward(torch.optim.SGD(parameters, lr=0.1))
    assert not steps_in_backward(torch.optim.SGD(parameters, lr=0.1, momentum=0.9))
    assert not steps_in_backward(torch.optim.Adam(parameters))
    assert not steps_in_backward(_StepAfterBackward(parameters, lr=0.1))
