"""Client algorithms: what a site does in a round, by the names of shared/algorithms/registry.py ALGORITHMS.

Each algorithm's rule names its client side ("module:attribute", `Algorithm.client`); cardiofl's
own are in site_agent/algorithms/builtin.py, a plug-in's in its own package. The site agent
(site_agent/local_round.py) and the in-process experiment runner dispatch through
CLIENT_ALGORITHMS, so both run the very same code.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from functools import cache

from shared.algorithms.registry import ALGORITHMS
from shared.errors import StudyRuleError
from site_agent.algorithms.base import ClientAlgorithm

__all__ = ["CLIENT_ALGORITHMS", "ClientAlgorithm"]


@cache
def _client(reference: str) -> ClientAlgorithm:
    """The ClientAlgorithm a rule names as "module:attribute", imported once."""
    module, _, attribute = reference.partition(":")
    client = getattr(importlib.import_module(module), attribute, None) if module and attribute else None
    if not isinstance(client, ClientAlgorithm):
        raise StudyRuleError(f"{reference!r} names no ClientAlgorithm")
    return client


class _Clients(Mapping[str, ClientAlgorithm]):
    """name -> the client side of every algorithm of shared.algorithms.registry.ALGORITHMS, imported on first use."""

    def __getitem__(self, name: str) -> ClientAlgorithm:
        return _client(ALGORITHMS[name].client)

    def __iter__(self) -> Iterator[str]:
        return iter(ALGORITHMS)

    def __len__(self) -> int:
        return len(ALGORITHMS)


CLIENT_ALGORITHMS = _Clients()
