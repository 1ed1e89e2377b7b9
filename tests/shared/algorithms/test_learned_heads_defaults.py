"""learned_heads' defaults are the cross-fitted method the shipped experiment configs run (experiments.md)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from shared.algorithms.params import LearnedHeadsParams

CONFIGS = Path(__file__).resolve().parents[3] / "cardiofl" / "experiment" / "configs"
SHIPPED = ("auto-heads.toml", "auto-heads-real.toml", "auto-heads-planted-separated.toml")


def learned_params(name: str) -> dict[str, object]:
    """The params of the learned_heads method of an experiment config."""
    methods = tomllib.loads((CONFIGS / name).read_text())["methods"]
    (learned,) = [method for method in methods if method.get("algorithm", {}).get("name") == "learned_heads"]
    params: dict[str, object] = learned["algorithm"]["params"]
    return params


def test_the_defaults_are_the_shipped_cross_fitted_method_but_for_its_study_length() -> None:
    for name in SHIPPED:
        params = learned_params(name)
        assert params["freeze_after"] is not None  # each config's own, for its rounds
        assert LearnedHeadsParams.model_validate({k: v for k, v in params.items() if k != "freeze_after"}) == (
            LearnedHeadsParams()
        ), name
    defaults = LearnedHeadsParams()
    assert defaults.probe_folds == 4 and defaults.evidence == "mean" and defaults.freeze_after is None


def test_the_planted_benchmark_names_the_carve_method_it_was_tuned_with() -> None:
    params = LearnedHeadsParams.model_validate(learned_params("auto-heads-planted.toml"))
    assert params.probe_folds == 0 and params.gate_test == "extremes" and params.undecided == "local"
    assert params.local_margin == 0.005 and params.block_margin == 0.024 and params.gate_bound == 2.0
