import math

import pytest
import torch
from torch import nn

from shared.model.network import (
    NO_HEADS,
    DualAttentionResNet1D,
    ModelConfig,
    build_model,
    head_ratios,
    parse_heads,
    preset,
    sinusoidal_encoding,
)
from shared.model.partition import model_partition, model_schema
from shared.terms import ModelSpec

ALL_RATIOS = head_ratios(8)


def test_head_ratios_are_the_nine_splits_of_eight() -> None:
    assert ALL_RATIOS == ["8:0", "7:1", "6:2", "5:3", "4:4", "3:5", "2:6", "1:7", "0:8"]


def test_backbone_matches_fedcvd_resnet1d34_parameter_count() -> None:
    # FedCVD resnet1d34: 16,611,220 trainable parameters, of which fc holds 10,260.
    with torch.device("meta"):
        model = DualAttentionResNet1D(preset("paper"))
    backbone = sum(p.numel() for p in model.backbone.parameters())
    assert backbone == 16_611_220 - 10_260 == 16_600_960
    assert sum(p.numel() for p in model.head.parameters()) == 10_260
    # 218 FedCVD state_dict entries minus fc.weight and fc.bias
    assert sum(1 for n in model.state_dict() if n.startswith("backbone.")) == 216
    # FedCVD: 17,060 BN buffer elements (running mean/var of 36 BNs plus their 36 counters)
    assert sum(b.numel() for b in model.backbone.buffers()) == 17_060


def fedcvd_resnet1d34_state_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """FedCVD `resnet1d34(12, 20)` state_dict names and shapes in order, from the spec's layer table (§1)."""

    def batchnorm(prefix: str, width: int) -> list[tuple[str, tuple[int, ...]]]:
        stats = ("weight", "bias", "running_mean", "running_var")
        return [(f"{prefix}.{s}", (width,)) for s in stats] + [(f"{prefix}.num_batches_tracked", ())]

    state = [("conv1.weight", (64, 12, 15)), *batchnorm("bn1", 64)]
    c_in = 64
    for layer, (width, depth) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True), start=1):
        for block in range(depth):
            prefix = f"layer{layer}.{block}"
            state += [(f"{prefix}.conv1.weight", (width, c_in, 7)), *batchnorm(f"{prefix}.bn1", width)]
            state += [(f"{prefix}.conv2.weight", (width, width, 7)), *batchnorm(f"{prefix}.bn2", width)]
            if block == 0 and layer > 1:
                state += [
                    (f"{prefix}.downsample.0.weight", (width, c_in, 1)),
                    *batchnorm(f"{prefix}.downsample.1", width),
                ]
            c_in = width
    return state + [("fc.weight", (20, 512)), ("fc.bias", (20,))]


def test_resnet1d34_preset_is_fedcvd_s_model_with_its_classifier() -> None:
    config = preset("resnet1d34")
    assert config.heads == NO_HEADS and not config.has_attention
    with torch.device("meta"):
        model = DualAttentionResNet1D(config)
    ours = [
        (name.removeprefix("backbone.").replace("head.", "fc.", 1), tuple(t.shape))
        for name, t in model.state_dict().items()
    ]
    assert ours == fedcvd_resnet1d34_state_shapes()  # same tensors, same order, FedCVD's names up to prefixes
    assert len(ours) == 218
    assert sum(t.numel() for t in model.state_dict().values()) == 16_628_280
    assert sum(p.numel() for p in model.parameters()) == 16_611_220
    assert len(list(model.parameters())) == 110  # FedALA's layer_idx counts back from head.bias
    assert [n for n, _ in model.named_parameters()][-2:] == ["head.weight", "head.bias"]
    assert not list(model.blocks) and sum(1 for _ in model.modules() if isinstance(_, nn.LayerNorm)) == 0


def test_resnet1d34_forward_is_mean_pooled_backbone_then_classifier() -> None:
    model = build_model(preset("resnet1d34"), seed=0).eval()
    x = torch.randn(2, 12, 5000)
    with torch.no_grad():
        features = model.backbone(x)
        assert features.shape == (2, 512, 157)
        expected = model.head(nn.functional.adaptive_avg_pool1d(features, 1).flatten(1))
        torch.testing.assert_close(model(x), expected)


def test_a_model_without_attention_takes_no_head_split() -> None:
    assert ModelSpec(preset="resnet1d34").heads == NO_HEADS
    assert ModelSpec(preset="resnet1d34", heads="-").config() == preset("resnet1d34")
    with pytest.raises(ValueError, match="no attention heads"):
        ModelSpec(preset="resnet1d34", heads="8:0")
    with pytest.raises(ValueError, match="give a head split"):
        ModelSpec(preset="paper", heads="-")
    assert ModelSpec(preset="paper").heads == "6:2"
    with pytest.raises(ValueError, match="n_heads=0"):
        ModelConfig(n_blocks=0)
    with pytest.raises(ValueError, match="at least one head"):
        ModelConfig(n_heads=0, n_global_heads=0)


def test_paper_preset_total_and_local_sizes_match_the_design() -> None:
    config = preset("paper", "6:2")
    with torch.device("meta"):
        model = DualAttentionResNet1D(config)
    total = sum(p.numel() for p in model.parameters())
    assert total == 23_968_660  # "about 24.0 M parameters"
    schema = model_schema(config)
    local = model_partition(config).local
    assert sum(schema[n].numel for n in local) == 526_080  # phi_k at 6:2


@pytest.mark.parametrize("heads", ALL_RATIOS)
def test_paper_preset_shapes_for_every_ratio(heads: str) -> None:
    config = preset("paper", heads)
    assert config.n_tokens == 157 == math.ceil(5000 / 32)
    with torch.device("meta"):
        model = DualAttentionResNet1D(config)
        x = torch.empty(2, 12, 5000)
        tokens = model.tokens(x)
        logits = model(x)
    assert tokens.shape == (2, 157, 512)
    assert logits.shape == (2, 20)


@pytest.mark.parametrize("heads", ALL_RATIOS)
def test_small_preset_forward_for_every_ratio(heads: str) -> None:
    model = build_model(preset("small", heads), seed=0).eval()
    x = torch.randn(3, 12, 5000)
    with torch.no_grad():
        assert model.tokens(x).shape == (3, 157, 128)
        logits = model(x)
    assert logits.shape == (3, 20)
    assert torch.isfinite(logits).all()


def test_paper_preset_real_forward_once() -> None:
    model = build_model(preset("paper", "6:2"), seed=0).eval()
    with torch.no_grad():
        logits = model(torch.randn(1, 12, 5000))
    assert logits.shape == (1, 20) and torch.isfinite(logits).all()


def test_zero_head_branch_is_layernorm_of_input() -> None:
    config = preset("tiny", "8:0")
    model = build_model(config, seed=1).eval()
    branch = model.blocks[0].local_branch
    x = torch.randn(2, 157, config.d_model)
    torch.testing.assert_close(branch(x), branch.norm(x))
    assert not hasattr(branch, "in_proj") and not hasattr(branch, "out_proj")


def test_same_seed_gives_bit_identical_state_and_different_seed_does_not() -> None:
    config = preset("small", "6:2")
    a, b, c = (build_model(config, seed=s).state_dict() for s in (7, 7, 8))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_build_model_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(preset("tiny"), seed=5)
    torch.testing.assert_close(torch.rand(3), expected)


def test_dropout_makes_train_mode_stochastic_and_eval_deterministic() -> None:
    model = build_model(preset("tiny", "4:4"), seed=0)
    x = torch.randn(2, 12, 5000)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_sinusoidal_encoding_values() -> None:
    table = sinusoidal_encoding(157, 8)
    assert table.shape == (157, 8)
    torch.testing.assert_close(table[0], torch.tensor([0.0, 1, 0, 1, 0, 1, 0, 1]))
    torch.testing.assert_close(table[3, 0], torch.sin(torch.tensor(3.0)))
    torch.testing.assert_close(table[3, 3], torch.cos(torch.tensor(3.0 / 10000 ** (2 / 8))))


@pytest.mark.parametrize("text", ["6", "a:b", "6:2:0", "0:0", ""])
def test_parse_heads_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_heads(text)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        ModelConfig(n_global_heads=9)
    with pytest.raises(ValueError):
        ModelConfig(dropout=1.0)
    with pytest.raises(ValueError):
        preset("huge")
