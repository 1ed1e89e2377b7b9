"""The names a study config may use: client algorithms and participation policies, each a small rule object.

ALGORITHMS holds every `cardiofl.algorithms` entry point of every installed distribution
(shared/plugins.py): cardiofl's own (shared/algorithms/builtin.py, registered by its
pyproject.toml) and any plug-in's, one path for both; the models are shared/model_config.py
PRESETS, the `cardiofl.models` entry points, the same way. A later algorithm is one more entry point;
nothing else branches on names. The terms validate names against these registries, and
shared/study.py applies them.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from pydantic import BaseModel

from shared.algorithms import exchange as declared
from shared.algorithms.exchange import Exchange
from shared.algorithms.participation import PARTICIPATIONS
from shared.algorithms.rule import Algorithm
from shared.model_config import PRESETS, ModelConfig
from shared.plugins import PluginIdentity, Registry

if TYPE_CHECKING:
    from shared.terms import StudyTerms

__all__ = [
    "ALGORITHMS",
    "PARTICIPATIONS",
    "Algorithm",
    "algorithm_plugin",
    "exchange_of",
    "model_of",
    "plugin_problem",
    "terms_plugin_problems",
    "terms_plugins",
]

ALGORITHMS: Registry[Algorithm] = Registry("cardiofl.algorithms", Algorithm, "algorithm")


def algorithm_plugin(name: str) -> PluginIdentity | None:
    """The identity of the plug-in that provides algorithm `name` here; None for cardiofl's own."""
    return ALGORITHMS.plugin(name)


def plugin_problem(name: str, named: PluginIdentity | None) -> str | None:
    """Why algorithm `name` as installed here is not the plug-in `named` by a study's terms; None when it is."""
    return ALGORITHMS.problem(name, named)


def terms_plugins(terms: StudyTerms) -> dict[str, PluginIdentity | None]:
    """The identities of the installed plug-ins that provide the terms' model and algorithm (None: a built-in)."""
    return {"model": PRESETS.plugin(terms.model.preset), "algorithm": ALGORITHMS.plugin(terms.algorithm.name)}


def terms_plugin_problems(terms: StudyTerms) -> list[str]:
    """Why this installation cannot run the terms' model or algorithm as the plug-ins they name; [] when it can."""
    problems = [
        PRESETS.problem(terms.model.preset, terms.model.plugin),
        ALGORITHMS.problem(terms.algorithm.name, terms.algorithm.plugin),
    ]
    return [problem for problem in problems if problem is not None]


@lru_cache(maxsize=64)
def exchange_of(config: ModelConfig, name: str, params: BaseModel) -> Exchange:
    """What a study of the model `config` under algorithm `name` with `params` exchanges and keeps."""
    config = model_of(config, name)
    return declared.with_site_batchnorm(config, ALGORITHMS[name].exchange(config, params))


def model_of(config: ModelConfig, name: str) -> ModelConfig:
    """The model the sites of a study of `config` under algorithm `name` train (learned_heads: the gated one)."""
    return ALGORITHMS[name].model(config)
