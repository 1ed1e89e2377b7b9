"""Small in-memory sites and one-call rounds for the client algorithms' tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.study.rules import initial_state, study_exchange
from shared.tensors.codec import TensorDict
from shared.terms import StudyTerms
from site_agent.algorithms.base import RoundContext
from site_agent.data.loader import SiteData, SplitArrays
from site_agent.data.report import LoadReport
from site_agent.device import resolve_runtime
from site_agent.local_round import (
    LocalRoundResult,
    LocalRoundSpec,
    round_context,
    run_local_evaluation,
    run_local_round,
)

RUNTIME = resolve_runtime("cpu")


def make_split(n: int, seed: int, signal_len: int = 5000) -> SplitArrays:
    """A split of n records whose class 0 shows as an offset on lead I: learnable, different per seed."""
    rng = np.random.default_rng(seed)
    labels = (rng.random((n, 20)) < 0.3).astype(np.float32)
    signals = rng.normal(0.0, 0.1, (n, 12, signal_len)).astype(np.float32)
    signals[:, 0, :] += labels[:, :1] * 2.0
    return SplitArrays(signals, labels, tuple(f"r{seed}-{i}" for i in range(n)))


def make_site(seed: int, n_train: int = 20, n_test: int = 6) -> SiteData:
    """A site's data held in memory."""
    return SiteData(make_split(n_train, seed), make_split(n_test, seed + 1000), LoadReport([]), Path("."))


@pytest.fixture(scope="session")
def site() -> SiteData:
    return make_site(1)


def study(algorithm: str = "fedavg", params: dict[str, Any] | None = None, **changes: Any) -> StudyTerms:
    """A tiny-model study with a few quick steps per round."""
    values: dict[str, Any] = {
        "model": {"preset": "tiny", "heads": "6:2"},
        "sites": ["lyon", "oslo"],
        "algorithm": {"name": algorithm, "params": params or {}},
        "training": {"lr": 0.05, "batch_size": 8, "max_steps": 2},
        "seed": 5,
        **changes,
    }
    return StudyTerms.model_validate(values)


def local_round(
    config: StudyTerms,
    data: SiteData,
    *,
    global_tensors: TensorDict | None = None,
    local_tensors: TensorDict | None = None,
    round_: int = 1,
    site: str = "lyon",
    load_factor: float = 1.0,
) -> LocalRoundResult:
    """One site's round of `config` from theta^g_0 / phi_0 unless other tensors are given."""
    theta, phi = initial_state(config)
    spec = LocalRoundSpec(config, site, round_, load_factor)
    return run_local_round(
        spec,
        study_exchange(config).partition,
        global_tensors=global_tensors if global_tensors is not None else theta,
        local_tensors=local_tensors if local_tensors is not None else phi,
        initial_local=phi,
        data=data,
        runtime=RUNTIME,
    )


def final_evaluation(
    config: StudyTerms, data: SiteData, *, global_tensors: TensorDict, local_tensors: TensorDict
) -> LocalRoundResult:
    """The final evaluation round of `config` at one site."""
    _, phi = initial_state(config)
    spec = LocalRoundSpec.of(config, "lyon", config.rounds + 1)
    return run_local_evaluation(
        spec, global_tensors=global_tensors, local_tensors=local_tensors, initial_local=phi, data=data, runtime=RUNTIME
    )


def assert_same(first: TensorDict, second: TensorDict) -> None:
    """Bit-identical tensors under the same names."""
    assert first.keys() == second.keys()
    different = [name for name in first if not first[name].equal(second[name])]
    assert not different, f"differ: {different[:5]}"


def differs(first: TensorDict, second: TensorDict) -> bool:
    """Whether any tensor of the common names differs."""
    return any(not first[name].equal(second[name]) for name in first.keys() & second.keys())


def context(
    config: StudyTerms,
    data: SiteData,
    *,
    global_tensors: TensorDict | None = None,
    state: TensorDict | None = None,
    round_: int = 2,
) -> RoundContext:
    """An algorithm's view of one round: theta^g_0 (or `global_tensors`), phi_0 and the kept `state`."""
    theta, phi = initial_state(config)
    spec = LocalRoundSpec.of(config, "lyon", round_)
    received = global_tensors if global_tensors is not None else theta
    return round_context(spec, study_exchange(config), received, {**phi, **(state or {})}, data, RUNTIME)
