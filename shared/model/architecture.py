"""A model family as PyTorch sees it: how a ModelConfig's network is built, and which of its state stays at a site.

A ModelConfig's `architecture` names its Architecture as "module:attribute" (shared/terms/model_config.py);
the config comes from the `cardiofl.models` entry points installed here, never from the wire, so
the module named is one the site's operator installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

from torch import nn

from shared.errors import ModelConfigError
from shared.terms.model_config import ModelConfig

__all__ = ["Architecture", "architecture_of"]


@dataclass(frozen=True)
class Architecture:
    """How to build a family's network from its config, and its partition rule.

    `build` makes the network with PyTorch's default init (the caller seeds and forks the RNG);
    `local` gives, among the names of the network's state_dict, those of phi_k: tensors that never
    leave a site. Everything else is theta^g, averaged across sites.
    """

    build: Callable[[ModelConfig], nn.Module]
    local: Callable[[ModelConfig, tuple[str, ...]], Iterable[str]]


@cache
def _resolve(reference: str) -> Architecture:
    module, _, attribute = reference.partition(":")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ModelConfigError(f"architecture {reference!r} cannot be loaded: {exc}") from exc
    if not isinstance(found, Architecture):
        raise ModelConfigError(f"architecture {reference!r} is a {type(found).__name__}, not an Architecture")
    return found


def architecture_of(config: ModelConfig) -> Architecture:
    """The Architecture that `config.architecture` names, loaded once."""
    return _resolve(config.architecture)
