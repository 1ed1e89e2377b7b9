"""The names a study config may use: client algorithms and participation policies, each a small rule object.

ALGORITHMS holds every `cardiofl.algorithms` entry point of every installed distribution
(shared/plugins.py): cardiofl's own (shared/algorithms/builtin.py, registered by its
pyproject.toml) and any plug-in's, one path for both; the models are shared/terms/model_config.py
PRESETS, the `cardiofl.models` entry points, the same way. A later algorithm is one more entry point;
nothing else branches on names. shared/study/checks.py checks a study's names and params against these
registries (`rules_of`, `parsed_params`), and shared/study/rules.py applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from shared.algorithms import exchange as declared
from shared.algorithms.exchange import Exchange
from shared.algorithms.participation import PARTICIPATIONS
from shared.algorithms.rule import Algorithm
from shared.algorithms.weightings import WEIGHTINGS
from shared.plugins import PluginIdentity, Registry
from shared.terms import AggregationSpec, AlgorithmSpec, ParticipationSpec, StudyTerms
from shared.terms.model_config import PRESETS, ModelConfig

__all__ = [
    "ALGORITHMS",
    "PARTICIPATIONS",
    "Algorithm",
    "PluginUse",
    "exchange_of",
    "model_of",
    "parsed_params",
    "plugin_uses",
    "rules_of",
    "terms_plugin_problems",
]

ALGORITHMS: Registry[Algorithm] = Registry("cardiofl.algorithms", Algorithm, "algorithm")


RuleSpec = AlgorithmSpec | AggregationSpec | ParticipationSpec


def rules_of(spec: RuleSpec) -> Mapping[str, Any]:
    """The registry `spec` names a rule of: name -> a rule with a `params` model."""
    if isinstance(spec, AlgorithmSpec):
        return ALGORITHMS
    if isinstance(spec, AggregationSpec):
        return WEIGHTINGS
    return PARTICIPATIONS


def parsed_params(spec: RuleSpec) -> BaseModel:
    """The params of `spec` as its rule's own typed model (a study's terms were checked: the rule exists)."""
    params: BaseModel = rules_of(spec)[spec.name].params.model_validate(spec.params)
    return params


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
