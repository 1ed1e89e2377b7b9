"""Client algorithms: what a site does in a round, by the names of shared/algorithms/registry.py ALGORITHMS.

Each algorithm's client side is a `cardiofl.clients` entry point of the same name, registered by the
same distribution as its rule (its `cardiofl.algorithms` entry point): cardiofl's own by its
pyproject.toml (site_agent/algorithms/builtin.py), a plug-in's by its own. A client from another
distribution than the rule is refused, so the plug-in identity a study names covers the code a site
runs. The site agent (site_agent/local_round.py) and the in-process experiment runner dispatch
through CLIENT_ALGORITHMS, so both run the very same code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from shared.algorithms.registry import ALGORITHMS
from shared.errors import StudyRuleError
from shared.plugins import Registry
from site_agent.algorithms.base import ClientAlgorithm

__all__ = ["CLIENTS", "CLIENT_ALGORITHMS", "ClientAlgorithm"]

# ClientAlgorithm is abstract: the registry only checks each entry point against it (isinstance).
CLIENTS: Registry[ClientAlgorithm] = Registry(
    "cardiofl.clients",
    ClientAlgorithm,  # type: ignore[type-abstract]
    "client algorithm",
)


class _Clients(Mapping[str, ClientAlgorithm]):
    """name -> the client side of every algorithm of ALGORITHMS, from the distribution that registered its rule."""

    def __getitem__(self, name: str) -> ClientAlgorithm:
        rule_owner = ALGORITHMS.distribution(name).metadata["Name"]  # KeyError: no such algorithm
        if name not in CLIENTS:
            raise StudyRuleError(
                f"algorithm {name!r} of {rule_owner!r} has no client side here: {rule_owner!r} registers no "
                f"`cardiofl.clients` entry point {name!r}"
            )
        client_owner = CLIENTS.distribution(name).metadata["Name"]
        if client_owner != rule_owner:
            raise StudyRuleError(
                f"the client of algorithm {name!r} comes from {client_owner!r}, its rule from {rule_owner!r}: one "
                "distribution registers both halves"
            )
        return CLIENTS[name]

    def __iter__(self) -> Iterator[str]:
        return iter(ALGORITHMS)

    def __len__(self) -> int:
        return len(ALGORITHMS)


CLIENT_ALGORITHMS = _Clients()
