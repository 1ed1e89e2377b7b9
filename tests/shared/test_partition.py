import pytest
import torch

from shared.model.network import build_model, head_ratios, preset
from shared.model.partition import Partition, model_partition, model_schema

ALL_RATIOS = head_ratios(8)


@pytest.mark.parametrize("heads", ALL_RATIOS)
def test_partition_is_disjoint_and_complete_for_every_ratio(heads: str) -> None:
    config = preset("paper", heads)
    partition = model_partition(config)
    names = list(model_schema(config))
    assert not set(partition.shared) & set(partition.local)
    assert sorted(partition.names) == sorted(names)
    assert len(partition.names) == len(names)


@pytest.mark.parametrize("heads", ALL_RATIOS)
def test_local_names_are_exactly_the_local_branch_projections(heads: str) -> None:
    config = preset("paper", heads)
    local = model_partition(config).local
    if config.n_local_heads == 0:
        assert local == ()
        return
    expected = {
        f"blocks.{b}.local_branch.{proj}.{kind}"
        for b in range(2)
        for proj in ("in_proj", "out_proj")
        for kind in ("weight", "bias")
    }
    assert set(local) == expected
    # LayerNorms of the local branch, W_c, FFN, BN buffers and the classifier stay global
    shared = set(model_partition(config).shared)
    assert {"blocks.0.local_branch.norm.weight", "blocks.1.combine.weight", "head.weight"} <= shared
    assert "backbone.bn1.running_mean" in shared and "backbone.bn1.num_batches_tracked" in shared


def test_eight_zero_has_empty_phi() -> None:
    assert model_partition(preset("paper", "8:0")).local == ()


def test_move_to_local_extends_the_partition() -> None:
    partition = model_partition(preset("tiny", "6:2"))
    fedper = partition.move_matching_to_local(r"^head\.")
    assert {"head.weight", "head.bias"} <= set(fedper.local)
    assert "head.weight" not in fedper.shared
    assert sorted(fedper.names) == sorted(partition.names)
    assert fedper.is_local("head.bias") and not partition.is_local("head.bias")
    with pytest.raises(ValueError, match="not in the model"):
        partition.move_to_local(["nope"])


def test_partition_rejects_overlap() -> None:
    with pytest.raises(ValueError):
        Partition(("a", "b"), ("b",))


def test_loading_new_global_tensors_leaves_local_tensors_untouched() -> None:
    config = preset("tiny", "6:2")
    partition = model_partition(config)
    site = build_model(config, seed=1)
    other = build_model(config, seed=2)
    before_shared, before_local = partition.split(site.state_dict())
    before_shared = {n: t.clone() for n, t in before_shared.items()}
    before_local = {n: t.clone() for n, t in before_local.items()}
    new_global, _ = partition.split(other.state_dict())
    site.load_state_dict(new_global, strict=False)
    after_shared, after_local = partition.split(site.state_dict())
    assert all(torch.equal(after_local[n], before_local[n]) for n in before_local)
    assert all(torch.equal(after_shared[n], new_global[n]) for n in new_global)
    assert not all(torch.equal(before_shared[n], new_global[n]) for n in new_global)


def test_split_refuses_a_state_with_other_names() -> None:
    partition = model_partition(preset("tiny"))
    state = dict(build_model(preset("tiny")).state_dict())
    state["extra"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        partition.split(state)
