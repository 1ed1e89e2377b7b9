import pytest
import torch

from shared.algorithms.exchange import FEDALA_BN, FEDALA_LOCAL, FEDALA_WEIGHT, model_names
from shared.study.rules import initial_state
from site_agent.algorithms import fedala as fedala_module
from site_agent.algorithms.fedala import adaptive_local_aggregation
from site_agent.data.loader import SiteData
from tests.site_agent.algorithms.conftest import assert_same, context, final_evaluation, local_round, study


def _own_head_bias(shift: float) -> dict[str, torch.Tensor]:
    theta, _ = initial_state(study("fedala"))
    return {FEDALA_LOCAL + "head.bias": theta["head.bias"] + shift}


@pytest.fixture()
def ala_epochs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Epochs each weight-learning call ran."""
    counts: list[int] = []
    original = fedala_module.learn_mix_weights

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        losses = original(*args, **kwargs)
        counts.append(len(losses))
        return losses

    monkeypatch.setattr(fedala_module, "learn_mix_weights", counting)
    return counts


def test_ala_is_off_until_the_site_has_a_model_of_its_own(site: SiteData, ala_epochs: list[int]) -> None:
    ctx = context(study("fedala"), site)
    start, weights = adaptive_local_aggregation(ctx)
    assert_same(start, ctx.start_state())
    assert weights == {} and ala_epochs == []
    result = local_round(study("fedala"), site)
    own_statistics = {FEDALA_BN + name for name in model_names(ctx.config).buffers}
    # no W yet: still the start phase
    assert set(result.local) - set(ctx.own) == {FEDALA_LOCAL + "head.bias"} | own_statistics


def test_weights_frozen_at_one_take_the_global_model(site: SiteData) -> None:
    ctx = context(study("fedala", {"eta": 0.0, "num_pre_loss": 1}), site, state=_own_head_bias(0.37))
    start, weights = adaptive_local_aggregation(ctx)
    assert_same(start, ctx.start_state())  # m + (g - m) * 1 is exactly g
    assert weights.keys() == {"head.bias"} and bool((weights["head.bias"] == 1).all())


def test_first_active_round_learns_until_the_losses_settle_then_one_epoch(
    site: SiteData, ala_epochs: list[int]
) -> None:
    params = {"eta": 1.0, "threshold": 10.0, "num_pre_loss": 3}  # settles as soon as 4 losses exist
    ctx = context(study("fedala", params), site, state=_own_head_bias(0.5))
    start, weights = adaptive_local_aggregation(ctx)
    assert ala_epochs == [4]
    learned = weights["head.bias"]
    assert bool(((learned >= 0) & (learned <= 1)).all()) and not bool((learned == 1).all())
    own, received = ctx.state[FEDALA_LOCAL + "head.bias"], ctx.received["head.bias"]
    torch.testing.assert_close(start["head.bias"], own + (received - own) * learned)
    assert_same(
        {n: t for n, t in start.items() if n != "head.bias"},
        {n: t for n, t in ctx.start_state().items() if n != "head.bias"},
    )

    later = context(study("fedala", params), site, state={**ctx.state, FEDALA_WEIGHT + "head.bias": learned})
    adaptive_local_aggregation(later)
    assert ala_epochs == [4, 1]  # W kept: one epoch per round from now on


def test_the_start_phase_stops_at_its_cap(site: SiteData, ala_epochs: list[int]) -> None:
    params = {"threshold": 0.0, "max_start_epochs": 2}
    adaptive_local_aggregation(context(study("fedala", params), site, state=_own_head_bias(0.5)))
    assert ala_epochs == [2]


def test_rounds_keep_w_and_the_trained_higher_layers(site: SiteData) -> None:
    config = study("fedala", {"layer_idx": 2, "threshold": 10.0, "num_pre_loss": 1})
    first = local_round(config, site)
    second = local_round(config, site, local_tensors=first.local, round_=2)
    kept = {n for n in second.local if n.startswith((FEDALA_LOCAL, FEDALA_WEIGHT))}
    assert kept == {
        FEDALA_LOCAL + "head.weight",
        FEDALA_LOCAL + "head.bias",
        FEDALA_WEIGHT + "head.weight",
        FEDALA_WEIGHT + "head.bias",
    }
    assert_same(
        {n: second.local[FEDALA_LOCAL + n] for n in ("head.weight", "head.bias")},
        {n: second.shared[n] for n in ("head.weight", "head.bias")},
    )
    theta, _ = initial_state(config)
    final = final_evaluation(config, site, global_tensors=theta, local_tensors=second.local)
    assert final.local == second.local  # evaluating adapts a copy; nothing kept changes


def test_averaged_bn_statistics_are_uploaded_and_the_site_starts_from_its_own(site: SiteData) -> None:
    config = study("fedala", {"threshold": 10.0, "num_pre_loss": 1})
    buffers = model_names(config.model.config()).buffers
    first = local_round(config, site)
    assert_same({n: first.shared[n] for n in buffers}, {n: first.local[FEDALA_BN + n] for n in buffers})
    theta, _ = initial_state(config)
    assert not any(torch.equal(first.shared[n], theta[n]) for n in buffers if n.endswith("running_var"))
    # theta^g holds other statistics (as if averaged with other sites); ALA copies parameters only
    received = {**theta, **{n: first.shared[n] + 1 for n in buffers}}
    ctx = context(config, site, global_tensors=received, state=first.local)
    start, _ = adaptive_local_aggregation(ctx)
    assert_same({n: start[n] for n in buffers}, {n: first.local[FEDALA_BN + n] for n in buffers})


def test_local_bn_statistics_stay_out_of_the_upload(site: SiteData) -> None:
    config = study("fedala", {"bn_statistics": "local"})
    result = local_round(config, site)
    buffers = set(model_names(config.model.config()).buffers)
    assert not buffers & result.shared.keys() and buffers <= result.local.keys()
    assert not any(name.startswith(FEDALA_BN) for name in result.local)
