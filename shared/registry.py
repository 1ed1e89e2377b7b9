"""The names a study config may use: client algorithms and participation policies, each a small rule object.

ALGORITHMS holds every `cardiofl.algorithms` entry point of every installed distribution
(shared/plugins.py): cardiofl's own (shared/algorithms/builtin.py, registered by its
pyproject.toml) and any plug-in's, one path for both; the models are shared/model_config.py
PRESETS, the `cardiofl.models` entry points, the same way. A later algorithm is one more entry point;
nothing else branches on names. The terms validate names against these registries, and
shared/study.py applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

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
    "PluginUse",
    "exchange_of",
    "model_of",
    "plugin_uses",
    "terms_plugin_problems",
]

ALGORITHMS: Registry[Algorithm] = Registry("cardiofl.algorithms", Algorithm, "algorithm")


@dataclass(frozen=True)
class PluginUse:
    """A model or algorithm a study's terms name, the plug-in identity they name for it, and its registry."""

    part: str  # the terms' section: "model" or "algorithm"
    name: str
    named: PluginIdentity | None
    registry: Registry[Any]

    @property
    def installed(self) -> PluginIdentity | None:
        """The identity of the plug-in that provides it here; None for cardiofl's own."""
        return self.registry.plugin(self.name)

    def problem(self) -> str | None:
        """Why this installation cannot run it as the plug-in the terms name; None when it can."""
        return self.registry.problem(self.name, self.named)


def plugin_uses(terms: StudyTerms) -> tuple[PluginUse, ...]:
    """The terms' model and algorithm, each with the plug-in identity the terms name for it."""
    return (
        PluginUse("model", terms.model.preset, terms.model.plugin, PRESETS),
        PluginUse("algorithm", terms.algorithm.name, terms.algorithm.plugin, ALGORITHMS),
    )


def terms_plugin_problems(terms: StudyTerms) -> list[str]:
    """Why this installation cannot run the terms' model or algorithm as the plug-ins they name; [] when it can."""
    return [problem for use in plugin_uses(terms) if (problem := use.problem()) is not None]


@lru_cache(maxsize=64)
def exchange_of(config: ModelConfig, name: str, params: BaseModel) -> Exchange:
    """What a study of the model `config` under algorithm `name` with `params` exchanges and keeps."""
    config = model_of(config, name)
    return declared.with_site_batchnorm(config, ALGORITHMS[name].exchange(config, params))


def model_of(config: ModelConfig, name: str) -> ModelConfig:
    """The model the sites of a study of `config` under algorithm `name` train (learned_heads: the gated one)."""
    return ALGORITHMS[name].model(config)
