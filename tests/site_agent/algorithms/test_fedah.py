import torch

from shared.algorithms.exchange import FEDAH_HEAD, FEDAH_WEIGHT
from shared.study.rules import initial_state, study_exchange
from site_agent.algorithms.adaptive import mix
from site_agent.algorithms.fedah import aggregated_head
from site_agent.data.loader import SiteData
from tests.site_agent.algorithms.conftest import assert_same, context, local_round, study

HEAD = ("head.weight", "head.bias")


def test_the_mix_is_exactly_the_global_head_at_one_and_the_local_head_at_zero() -> None:
    generator = torch.Generator().manual_seed(0)
    own, received = torch.randn(20, 32, generator=generator), torch.randn(20, 32, generator=generator)
    assert torch.equal(mix(own, received, torch.ones_like(own)), received)
    assert torch.equal(mix(own, received, torch.zeros_like(own)), own)
    half = mix(own, received, torch.full_like(own, 0.5))
    torch.testing.assert_close(half, (own + received) / 2)


def _kept(shift: float, weight: float) -> dict[str, torch.Tensor]:
    theta, _ = initial_state(study("fedah"))
    own = {FEDAH_HEAD + n: theta[n] + shift for n in HEAD}
    return {**own, **{FEDAH_WEIGHT + n: torch.full_like(theta[n], weight) for n in HEAD}}


def test_aggregated_head_with_fixed_weights_is_the_global_or_the_local_head(site: SiteData) -> None:
    for weight, expected in ((1.0, "global"), (0.0, "local")):
        ctx = context(study("fedah", {"eta": 0.0}), site, state=_kept(0.3, weight))
        start, weights = aggregated_head(ctx)
        heads = {n: start[n] for n in HEAD}
        reference = ctx.received if expected == "global" else {n: ctx.state[FEDAH_HEAD + n] for n in HEAD}
        assert_same(heads, {n: reference[n] for n in HEAD})
        assert all(bool((weights[n] == weight).all()) for n in HEAD)
        assert_same(
            {n: t for n, t in start.items() if n not in HEAD},
            {n: t for n, t in ctx.start_state().items() if n not in HEAD},
        )


def test_head_weights_learn_within_bounds(site: SiteData) -> None:
    ctx = context(study("fedah", {"eta": 5.0}), site, state=_kept(0.3, 1.0))
    start, weights = aggregated_head(ctx)
    assert all(bool(((weights[n] >= 0) & (weights[n] <= 1)).all()) for n in HEAD)
    assert any(not bool((weights[n] == 1).all()) for n in HEAD)
    own = {n: ctx.state[FEDAH_HEAD + n] for n in HEAD}
    for n in HEAD:
        torch.testing.assert_close(start[n], own[n] + (ctx.received[n] - own[n]) * weights[n])


def test_a_round_uploads_the_whole_model_and_keeps_its_trained_head(site: SiteData) -> None:
    config = study("fedah")
    first = local_round(config, site)
    assert set(first.shared) == set(study_exchange(config).upload_schema())
    assert "head.weight" in first.shared and "backbone.bn1.running_mean" not in first.shared  # BN statistics stay
    assert_same({n: first.local[FEDAH_HEAD + n] for n in HEAD}, {n: first.shared[n] for n in HEAD})
    # round 1: h_l = h_g, so W has no gradient and stays at ones
    assert all(bool((first.local[FEDAH_WEIGHT + n] == 1).all()) for n in HEAD)
    second = local_round(config, site, local_tensors=first.local, round_=2)
    assert {n for n in second.local if n.startswith("fedah.")} == {
        p + n for p in (FEDAH_HEAD, FEDAH_WEIGHT) for n in HEAD
    }
