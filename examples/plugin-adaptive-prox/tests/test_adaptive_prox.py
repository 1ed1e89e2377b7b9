"""The plug-in on its own: mu's rule, its registration, and its rounds (cardiofl installed beside it)."""

from __future__ import annotations

import math

import pytest
from cardiofl_adaptive_prox.client import next_mu
from cardiofl_adaptive_prox.rule import FALLING, LOSS, MU, AdaptiveProxParams

PARAMS = AdaptiveProxParams(mu=0.5, step=0.1, patience=2)


def test_mu_rises_when_the_loss_rose_and_falls_after_patience_falls() -> None:
    """Li et al.'s heuristic, one round at a time."""
    assert next_mu(0.5, math.nan, 1.0, 0, PARAMS) == (0.5, 0)  # the first round has nothing to compare
    assert next_mu(0.5, 1.0, 1.2, 1, PARAMS) == pytest.approx((0.6, 0))
    assert next_mu(0.5, 1.0, 0.9, 0, PARAMS) == (0.5, 1)
    assert next_mu(0.5, 1.0, 0.9, 1, PARAMS) == pytest.approx((0.4, 0))
    assert next_mu(0.05, 1.0, 0.9, 1, PARAMS) == (0.0, 0)  # never below 0


def test_the_rule_registers_through_its_entry_point() -> None:
    """Cardiofl's registry finds the rule and its client, and names the distribution that provides them."""
    from shared.registry import ALGORITHMS, algorithm_plugin
    from site_agent.algorithms import CLIENT_ALGORITHMS

    assert (
        "fedprox_adaptive" in ALGORITHMS and type(CLIENT_ALGORITHMS["fedprox_adaptive"]).__name__ == "AdaptiveFedProx"
    )
    identity = algorithm_plugin("fedprox_adaptive")
    assert identity is not None and identity.distribution == "cardiofl-adaptive-prox" and identity.version == "0.1.0"


def test_a_study_keeps_each_sites_mu_as_its_own() -> None:
    """mu, the last loss and the falling count are site state: kept, never uploaded."""
    from shared.study import algorithm_exchange
    from shared.terms import AlgorithmSpec, ModelSpec

    exchange = algorithm_exchange(ModelSpec(preset="tiny"), AlgorithmSpec(name="fedprox_adaptive"))
    assert {MU, LOSS, FALLING} <= exchange.local_names()
    assert not {MU, LOSS, FALLING} & set(exchange.upload_schema())  # nothing of it leaves the site
