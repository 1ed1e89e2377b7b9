import pytest
import torch

from shared.algorithms.exchange import (
    DITTO_PERSONAL,
    FEDAH_HEAD,
    FEDAH_WEIGHT,
    FEDALA_BN,
    FEDALA_LOCAL,
    FEDALA_WEIGHT,
    GLOBAL,
    GLOBAL_SITE_BN,
    OWN_MODELS,
    SCAFFOLD_C,
    SCAFFOLD_C_K,
    SCAFFOLD_DELTA_C,
    Exchange,
    fedala_higher,
    model_names,
)
from shared.algorithms.registry import ALGORITHMS, model_of
from shared.model.network import preset
from shared.model.partition import LOCAL_BRANCH_PATTERN, model_partition, model_schema
from shared.study.rules import global_schema, initial_state, shared_schema, study_exchange
from shared.terms import StudyTerms

CONFIG = preset("tiny", "6:2")
SCHEMA = model_schema(CONFIG)
NAMES = model_names(CONFIG)
LOCAL_BRANCHES = {name for name in SCHEMA if LOCAL_BRANCH_PATTERN.match(name)}


def study(name: str, heads: str = "6:2", **params: object) -> StudyTerms:
    return StudyTerms(
        model={"preset": "tiny", "heads": heads}, sites=["a", "b"], algorithm={"name": name, "params": params}
    )


def test_model_names_follow_the_model() -> None:
    assert NAMES.parameters[-2:] == ("head.weight", "head.bias")  # the head is registered last
    assert NAMES.head == ("head.weight", "head.bias")
    assert "backbone.bn1.running_mean" in NAMES.buffers and "backbone.bn1.weight" not in NAMES.buffers
    assert set(NAMES.parameters) | set(NAMES.buffers) == set(SCHEMA)
    assert {"backbone.bn1.weight", "backbone.bn1.num_batches_tracked", "backbone.layer2.0.downsample.1.bias"} <= set(
        NAMES.batchnorm
    )
    assert not any(".norm." in name for name in NAMES.batchnorm)  # LayerNorms are not BatchNorms


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("heads", ["6:2", "8:0"])
def test_every_algorithm_composes_with_the_dual_attention_split(name: str, heads: str) -> None:
    config = study(name, heads)
    exchange = study_exchange(config)
    partition = exchange.partition
    model = model_of(preset("tiny", heads), name)  # the model its sites train (learned_heads: gated)
    assert set(partition.names) == set(model_schema(model))
    assert set(model_partition(model).local) <= set(partition.local)  # phi_k stays phi_k
    upload = shared_schema(config)
    assert upload == exchange.upload_schema()
    assert not upload.keys() & exchange.local_names()
    assert not global_schema(config.model, config.algorithm).keys() & exchange.local_names()
    theta, phi = initial_state(config)
    assert theta.keys() == exchange.global_schema().keys() and phi.keys() == set(partition.local)
    assert all(tuple(t.shape) == exchange.global_schema()[n].shape for n, t in theta.items())


def test_plain_algorithms_keep_feddualatt_s_partition() -> None:
    for name in ("fedavg", "fedprox"):
        exchange = study_exchange(study(name))
        assert set(exchange.partition.local) == LOCAL_BRANCHES
        assert not (exchange.server_state or exchange.uploads or exchange.site_state)


def test_local_keeps_the_whole_model_at_the_site_and_exchanges_no_tensor() -> None:
    config = study("local")
    exchange = study_exchange(config)
    assert exchange.partition.shared == () and set(exchange.partition.local) == set(SCHEMA)
    assert exchange.upload_schema() == exchange.global_schema() == shared_schema(config) == {}
    assert not (exchange.server_state or exchange.uploads or exchange.site_state)
    assert set(exchange.own_in_global) == set(SCHEMA) and exchange.global_label() == OWN_MODELS  # Global: its own model
    theta, phi = initial_state(config)
    assert theta == {} and phi.keys() == SCHEMA.keys()


def test_fedbn_with_all_keeps_every_batchnorm_layer_local() -> None:
    local = set(study_exchange(study("fedbn", local_batchnorm="all")).partition.local)
    assert local == LOCAL_BRANCHES | set(NAMES.batchnorm)
    assert "blocks.0.norm.weight" not in local and "head.weight" not in local


def test_fedbn_by_default_keeps_fedcvd_s_bn_named_layers_and_shares_the_downsample_batchnorm() -> None:
    exchange = study_exchange(study("fedbn"))
    downsample = {n for n in NAMES.batchnorm if ".downsample.1." in n}
    assert len(downsample) == 3 * 5  # layer2..4: weight, bias, running mean and var, step count
    assert set(exchange.partition.local) == LOCAL_BRANCHES | (set(NAMES.batchnorm) - downsample)
    assert downsample <= set(exchange.upload_schema())


def test_fedper_and_fedrep_keep_the_classifier_and_by_default_the_bn_statistics_local() -> None:
    classifier = {"head.weight", "head.bias"}
    for name in ("fedper", "fedrep"):
        local = set(study_exchange(study(name)).partition.local)
        assert local == LOCAL_BRANCHES | classifier | set(NAMES.buffers)
        assert "backbone.bn1.weight" not in local  # BatchNorm's affine parameters are shared
        shared_statistics = set(study_exchange(study(name, bn_statistics="shared")).partition.local)
        assert shared_statistics == LOCAL_BRANCHES | classifier


def test_scaffold_exchanges_control_variates_of_the_shared_parameters() -> None:
    exchange = study_exchange(study("scaffold"))
    parameters = [n for n in NAMES.parameters if n not in LOCAL_BRANCHES]
    assert list(exchange.server_state) == [SCAFFOLD_C + n for n in parameters]
    assert list(exchange.uploads) == [SCAFFOLD_DELTA_C + n for n in parameters]
    assert list(exchange.site_state) == [SCAFFOLD_C_K + n for n in parameters]
    theta, _ = initial_state(study("scaffold"))
    assert all(bool((theta[SCAFFOLD_C + n] == 0).all()) for n in parameters)  # c starts at zero


def test_ditto_keeps_a_whole_personal_model() -> None:
    exchange = study_exchange(study("ditto"))
    assert exchange.site_state == {DITTO_PERSONAL + n: spec for n, spec in SCHEMA.items()}
    assert set(exchange.partition.local) == LOCAL_BRANCHES


def test_fedala_as_fedcvd_averages_bn_statistics_and_keeps_a_copy() -> None:
    exchange = study_exchange(study("fedala"))
    assert set(exchange.partition.local) == LOCAL_BRANCHES
    assert set(NAMES.buffers) <= exchange.upload_schema().keys()
    own_statistics = {FEDALA_BN + name for name in NAMES.buffers}
    assert set(exchange.site_state) == {FEDALA_WEIGHT + "head.bias", FEDALA_LOCAL + "head.bias"} | own_statistics
    assert exchange.own_in_global == () and exchange.global_label() == GLOBAL


def test_fedala_as_pfllib_mixes_the_trailing_parameters_and_keeps_bn_statistics() -> None:
    exchange = study_exchange(study("fedala", bn_statistics="local"))
    assert set(exchange.partition.local) == LOCAL_BRANCHES | set(NAMES.buffers)
    assert set(exchange.site_state) == {FEDALA_WEIGHT + "head.bias", FEDALA_LOCAL + "head.bias"}
    assert set(exchange.own_in_global) == set(NAMES.buffers) and exchange.global_label() == GLOBAL_SITE_BN
    partition = exchange.partition
    assert fedala_higher(CONFIG, partition, 1) == ("head.bias",)
    assert fedala_higher(CONFIG, partition, 2) == ("head.weight", "head.bias")
    everything = fedala_higher(CONFIG, partition, 10_000)  # PFLlib's params[-layer_idx:] takes them all
    assert set(everything) == set(NAMES.parameters) - LOCAL_BRANCHES


def test_fedah_shares_the_head_and_keeps_its_own_head_and_weights() -> None:
    exchange = study_exchange(study("fedah"))
    assert {"head.weight", "head.bias"} <= exchange.upload_schema().keys()
    assert set(exchange.site_state) == {p + n for p in (FEDAH_HEAD, FEDAH_WEIGHT) for n in ("head.weight", "head.bias")}
    assert "backbone.bn1.running_var" in exchange.partition.local


def test_extra_names_may_not_shadow_model_names() -> None:
    partition = model_partition(CONFIG)
    with pytest.raises(ValueError, match="new and distinct"):
        Exchange(partition, SCHEMA, uploads={"head.bias": SCHEMA["head.bias"]})
    spec = SCHEMA["head.bias"]
    with pytest.raises(ValueError, match="new and distinct"):
        Exchange(partition, SCHEMA, uploads={"x.y": spec}, site_state={"x.y": spec})


def test_initial_server_state_matches_its_schema() -> None:
    config = study("scaffold", server_lr=0.5)
    theta, _ = initial_state(config)
    state = study_exchange(config).server_state
    assert state and all(theta[n].dtype == spec.dtype == torch.float32 for n, spec in state.items())
    assert all(tuple(theta[n].shape) == spec.shape for n, spec in state.items())
