"""The names a study config may use: client algorithms and participation policies, each a small rule object.

ALGORITHMS holds every `cardiofl.algorithms` entry point of every installed distribution
(shared/plugins.py): cardiofl's own (shared/algorithms/builtin.py, registered by its
pyproject.toml) and any plug-in's, one path for both. A later algorithm is one more entry point;
nothing else branches on names. The terms validate names against these registries, and
shared/study.py applies them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import lru_cache
from importlib import metadata

from pydantic import BaseModel

from shared.algorithms import exchange as declared
from shared.algorithms.exchange import Exchange
from shared.algorithms.participation import PARTICIPATIONS
from shared.algorithms.rule import Algorithm
from shared.errors import StudyRuleError
from shared.model_config import ModelConfig
from shared.plugins import OWN_DISTRIBUTION, PluginIdentity, is_editable, load_group, plugin_identity

__all__ = ["ALGORITHMS", "PARTICIPATIONS", "Algorithm", "algorithm_plugin", "exchange_of", "model_of", "plugin_problem"]

ALGORITHM_GROUP = "cardiofl.algorithms"


class _Registry(Mapping[str, Algorithm]):
    """name -> Algorithm of every installed `cardiofl.algorithms` entry point, read on first use."""

    def _rules(self) -> Mapping[str, tuple[object, metadata.Distribution]]:
        rules = load_group(ALGORITHM_GROUP)
        for name, (rule, distribution) in rules.items():
            if not isinstance(rule, Algorithm):
                owner = distribution.metadata["Name"]
                raise StudyRuleError(f"algorithm {name!r} of {owner!r} is a {type(rule).__name__}, not an Algorithm")
        return rules

    def __getitem__(self, name: str) -> Algorithm:
        rule, _ = self._rules()[name]
        assert isinstance(rule, Algorithm)
        return rule

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules())

    def __len__(self) -> int:
        return len(self._rules())

    def distribution(self, name: str) -> metadata.Distribution:
        """The distribution that registered algorithm `name`."""
        return self._rules()[name][1]


ALGORITHMS = _Registry()


def algorithm_plugin(name: str) -> PluginIdentity | None:
    """The identity of the plug-in that provides algorithm `name` here; None for cardiofl's own."""
    distribution = ALGORITHMS.distribution(name)
    return None if distribution.metadata["Name"] == OWN_DISTRIBUTION else _identity(distribution)


@lru_cache(maxsize=64)
def _identity(distribution: metadata.Distribution) -> PluginIdentity:
    return plugin_identity(distribution)


def plugin_problem(name: str, named: PluginIdentity | None) -> str | None:
    """Why algorithm `name` as installed here is not the plug-in `named` by a study's terms; None when it is.

    A built-in must be named by no plug-in; a plug-in's distribution, version and files' hash must
    all equal the terms', and its installation must not be editable.
    """
    distribution = ALGORITHMS.distribution(name)
    here = algorithm_plugin(name)
    if here is None:
        if named is None:
            return None
        return f"algorithm {name!r} is built into cardiofl here; the terms name {_show(named)}"
    if named is None:
        return f"algorithm {name!r} is plug-in {_show(here)} here, and the terms name no plug-in for it"
    if is_editable(distribution):
        return f"algorithm {name!r}'s plug-in {here.distribution!r} is installed editable here, which sites refuse"
    if here != named:
        return f"algorithm {name!r}: this site has {_show(here)}, the terms name {_show(named)}"
    return None


def _show(identity: PluginIdentity) -> str:
    return f"{identity.distribution} {identity.version} (files {identity.sha256[:12]})"


@lru_cache(maxsize=64)
def exchange_of(config: ModelConfig, name: str, params: BaseModel) -> Exchange:
    """What a study of the model `config` under algorithm `name` with `params` exchanges and keeps."""
    config = model_of(config, name)
    return declared.with_site_batchnorm(config, ALGORITHMS[name].exchange(config, params))


def model_of(config: ModelConfig, name: str) -> ModelConfig:
    """The model the sites of a study of `config` under algorithm `name` train (learned_heads: the gated one)."""
    return ALGORITHMS[name].model(config)
