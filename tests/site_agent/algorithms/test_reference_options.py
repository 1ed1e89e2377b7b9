"""The options that pick a reference implementation's behaviour: FedCVD's Scaffold, FedALA's mode, FedAH's rate."""

import torch

from shared.algorithms.exchange import FEDAH_HEAD, FEDAH_WEIGHT, FEDALA_LOCAL, SCAFFOLD_C, SCAFFOLD_DELTA_C
from shared.model.network import build_model, preset
from shared.study.rules import initial_state
from site_agent.algorithms.adaptive import learn_mix_weights
from site_agent.algorithms.fedah import aggregated_head
from site_agent.algorithms.fedala import adaptive_local_aggregation
from site_agent.data.loader import SiteData
from tests.site_agent.algorithms.conftest import RUNTIME, assert_same, context, differs, local_round, study

HEAD = ("head.weight", "head.bias")


def _with_c(name: str, value: float) -> dict[str, torch.Tensor]:
    theta, _ = initial_state(study(name))
    return {n: torch.full_like(t, value) if n.startswith(SCAFFOLD_C) else t for n, t in theta.items()}


def _model_part(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in tensors.items() if not n.startswith("scaffold.")}


def test_fedcvd_scaffold_ignores_c_and_trains_as_fedavg_yet_exchanges_delta_c(site: SiteData) -> None:
    fedavg = local_round(study("fedavg"), site)
    as_shipped = local_round(study("scaffold_fedcvd"), site, global_tensors=_with_c("scaffold_fedcvd", 0.05))
    corrected = local_round(study("scaffold"), site, global_tensors=_with_c("scaffold", 0.05))
    assert_same(_model_part(as_shipped.shared), fedavg.shared)
    assert differs(_model_part(corrected.shared), fedavg.shared)
    # FedCVD still computes dc = -dy / (K lr) - c and the server still adds it to c
    steps = as_shipped.meta.metrics.model_extra["train_steps"]  # type: ignore[index]
    theta, _ = initial_state(study("scaffold_fedcvd"))
    expected = -0.05 + (theta["head.bias"] - as_shipped.shared["head.bias"]) / (steps * 0.05)
    torch.testing.assert_close(as_shipped.shared[SCAFFOLD_DELTA_C + "head.bias"], expected, rtol=1e-5, atol=1e-6)


def _learn_head_bias(train_mode: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    model = build_model(preset("tiny", "6:2"), seed=3)
    received = {"head.bias": model.head.bias.detach().clone()}
    own = {"head.bias": received["head.bias"] + 0.5}
    weights = {"head.bias": torch.ones_like(own["head.bias"])}
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(6, 12, 5000, generator=generator), (torch.rand(6, 20, generator=generator) < 0.3).float())
    learn_mix_weights(
        model,
        ("head.bias",),
        own,
        received,
        weights,
        lambda: iter([batch]),
        eta=1.0,
        done=lambda losses: True,
        runtime=RUNTIME,
        train_mode=train_mode,
    )
    return model, weights["head.bias"]


def test_weights_learned_in_eval_mode_leave_batchnorm_statistics_alone() -> None:
    untouched = build_model(preset("tiny", "6:2"), seed=3).backbone.bn1.running_mean
    in_eval, eval_weight = _learn_head_bias(train_mode=False)
    in_train, train_weight = _learn_head_bias(train_mode=True)
    assert not in_eval.training and in_train.training
    assert torch.equal(in_eval.backbone.bn1.running_mean, untouched)
    assert not torch.equal(in_train.backbone.bn1.running_mean, untouched)
    assert not torch.equal(eval_weight, train_weight)  # batch statistics give other gradients


def test_fedala_s_weight_learning_mode_reaches_the_weight_learning(site: SiteData) -> None:
    learned = {}
    for mode in ("eval", "train"):
        config = study("fedala", {"weight_learning_mode": mode, "max_start_epochs": 1})
        theta, _ = initial_state(config)
        ctx = context(config, site, state={FEDALA_LOCAL + "head.bias": theta["head.bias"] + 0.3})
        learned[mode] = adaptive_local_aggregation(ctx)[1]
    assert learned["eval"].keys() == learned["train"].keys() == {"head.bias"}
    assert differs(learned["eval"], learned["train"])


def test_fedah_learns_w_at_eta_or_at_the_training_lr(site: SiteData) -> None:
    theta, _ = initial_state(study("fedah"))
    kept = {FEDAH_HEAD + n: theta[n] + 0.3 for n in HEAD}
    kept |= {FEDAH_WEIGHT + n: torch.full_like(theta[n], 0.5) for n in HEAD}
    moved = {}
    for eta_is_local_lr, lr in ((False, 0.05), (True, 0.05), (True, 0.1)):
        config = study("fedah", {"eta": 1.0, "eta_is_local_lr": eta_is_local_lr}, training={"lr": lr, "batch_size": 8})
        _, weights = aggregated_head(context(config, site, state=kept))
        moved[(eta_is_local_lr, lr)] = (weights["head.bias"] - 0.5).abs().sum().item()
    assert all(value > 0 for value in moved.values())
    # one epoch from the same W: a smaller rate moves W less, and the lr-driven steps follow the lr
    assert moved[(True, 0.05)] < moved[(True, 0.1)] < moved[(False, 0.05)]
