"""Every algorithm's global evaluation model holds only aggregated, documented phi_0 or labelled site tensors."""

from __future__ import annotations

import itertools
import typing
from collections.abc import Iterator

import pytest
import torch
from pydantic import BaseModel

from shared.algorithms.exchange import GLOBAL, GLOBAL_SITE_BN, OWN_MODELS, Exchange, model_names
from shared.algorithms.learned_heads import gate_names
from shared.algorithms.registry import ALGORITHMS, exchange_of, model_of
from shared.model.network import preset
from shared.model.partition import LOCAL_BRANCH_PATTERN, model_schema

THETA_G, SITE_OWN, PHI_0 = 1, 2, 3  # a fill value per source, to tell where each tensor came from


def _variants() -> Iterator[tuple[str, str, BaseModel]]:
    """(heads, algorithm, params) for every algorithm, every value of each of its choice parameters."""
    for heads, (name, rule) in itertools.product(("6:2", "8:0"), ALGORITHMS.items()):
        choices = {
            field: typing.get_args(info.annotation)
            for field, info in rule.params.model_fields.items()
            if typing.get_origin(info.annotation) is typing.Literal
        }
        for values in itertools.product(*choices.values()):
            yield heads, name, rule.params.model_validate(dict(zip(choices, values, strict=True)))


def _filled(exchange: Exchange, names: tuple[str, ...], value: int) -> dict[str, torch.Tensor]:
    return {name: torch.full(exchange.schema[name].shape, value, dtype=exchange.schema[name].dtype) for name in names}


@pytest.mark.parametrize(("heads", "algorithm", "params"), list(_variants()), ids=lambda v: str(v))
def test_global_evaluation_model_has_no_tensor_neither_trained_nor_aggregated(
    heads: str, algorithm: str, params: BaseModel
) -> None:
    config = model_of(preset("tiny", heads), algorithm)  # the model the study's sites train
    exchange = exchange_of(config, algorithm, params)
    partition = exchange.partition
    state = exchange.global_evaluation_state(
        _filled(exchange, partition.shared, THETA_G),
        _filled(exchange, partition.local, SITE_OWN),
        _filled(exchange, partition.local, PHI_0),
    )
    assert state.keys() == model_schema(config).keys()
    names = model_names(config)
    documented_heads = {n for n in partition.local if LOCAL_BRANCH_PATTERN.match(n)} | set(names.head)
    source = {name: int(tensor.flatten()[0]) for name, tensor in state.items()}
    for name, value in source.items():
        if value == THETA_G:
            assert name in partition.shared
        elif value == PHI_0:
            assert name in documented_heads, f"{name} is phi_0 but no documented local head"
        elif name in exchange.fixed_in_global:  # learned_heads: every gate global, by definition
            assert name in gate_names(config) and float(state[name].flatten()[0]) == -1e4
        elif not partition.shared:  # the local baseline: no theta^g, the site's own model whole
            assert value == SITE_OWN and exchange.global_label() == OWN_MODELS
        else:
            assert name in names.batchnorm and exchange.global_label() == GLOBAL_SITE_BN, name
    from_site = {name for name, value in source.items() if value == SITE_OWN}
    label = OWN_MODELS if from_site == state.keys() else GLOBAL_SITE_BN if from_site else GLOBAL
    assert exchange.global_label() == label


def test_fedbn_and_local_statistics_evaluate_with_the_site_s_batchnorm() -> None:
    config = preset("tiny", "6:2")
    fedbn = exchange_of(config, "fedbn", ALGORITHMS["fedbn"].params())
    assert fedbn.own_in_global and set(fedbn.own_in_global) <= set(model_names(config).batchnorm)
    pfllib_ala = exchange_of(config, "fedala", ALGORITHMS["fedala"].params(bn_statistics="local"))
    assert set(pfllib_ala.own_in_global) == set(model_names(config).buffers)
    fedcvd_ala = exchange_of(config, "fedala", ALGORITHMS["fedala"].params())
    assert fedcvd_ala.own_in_global == () and fedcvd_ala.global_label() == GLOBAL
