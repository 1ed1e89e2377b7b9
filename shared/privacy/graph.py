"""The SecAgg+ neighbour graph and its parameters (Bell et al., CCS 2020, on Bonawitz et al., CCS 2017).

In SecAgg+ a site agrees masks with, and Shamir-shares its secrets among, only its k neighbours
in a sparse graph instead of all K - 1 other sites, so each site's work and messages grow with k
rather than K. The graph is a Harary graph H(k, K) (the K sites on a ring, each joined to the k/2
nearest on either side) over a pseudorandom ordering of the sites, derived from a public
per-round seed so that every site and the server compute the same graph, and no one chooses it.

Without a stated adversary (`RoundSetup.create`'s defaults, an in-process simulation): k =
min(K - 1, 2 * ceil(log2 K) + 2), even so that H(k, K) is well defined, and t = floor(k / 2) + 1.

Against a server that lies and colludes with up to c sites (`adversary_parameters`), a site's
secrets must survive a server that tells different honest neighbours different stories. Each
honest neighbour reveals one kind of share per round attempt (of a survivor's self-mask seed, or
of a dropped site's mask key), so a server that splits a site X's honest neighbours into two
groups, telling one "X survived" and the other "X dropped", collects |G1| + m shares of X's
self-mask seed and |G2| + m of its mask key, where m is the number of colluders among X's
neighbours and |G1| + |G2| <= k - m. It unmasks X's input when both reach t, which is possible
exactly when 2t <= k + m. So the threshold is split-proof:

* t = floor((k + m) / 2) + 1, the smallest t with 2t > k + m (and so t > m: the colluders alone
  never hold t shares). In the complete graph (up to COMPLETE_UP_TO sites) m = c. In a sparse
  graph m is the smallest count with K * P[Hypergeom(K - 1, c, k) > m] <= 2^-FAILURE_BITS (a union
  bound over the sites; a site's k neighbours are a uniform draw from the K - 1 others, since the
  ordering comes from a seed no one chooses), and k is the smallest even count from the default
  above up with m <= k / 2 (else the graph is complete), so a neighbourhood keeps about k / 4
  dropouts in hand.
* The consistency check (each survivor signs the survivor set and the advertisers it was told, and
  reveals nothing until it holds a quorum of valid signatures on its own) takes
  q = floor((K + c) / 2) + 1 signatures of the round's K sites, the site's own included: two
  stories would need 2q <= K + c signers (the c colluders sign both), so at most one survivor set
  and one advertiser set (each site's weight is normalised over it) can gather q.
* min_survivors = max(t + 1, q, c + 2): a survivor's self-mask seed is rebuilt from t shares its
  other surviving neighbours hold (a site holds none of its own), q survivors must sign, and the
  server and its colluders, subtracting their own inputs, are left with a sum of at least two
  honest sites. A round of K sites tolerates K - min_survivors dropouts (and, in a sparse graph,
  at most k - t among any one site's neighbours).

Explicit `neighbour_count` and `threshold` are taken only when they meet the same bounds; both the
coordinator (creating a study) and every site (reading the terms it approves) run this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from shared.errors import PrivacyInputError
from shared.privacy.errors import SetupError
from shared.privacy.prg import random_uint64

__all__ = [
    "COMPLETE_UP_TO",
    "FAILURE_BITS",
    "SecureParameters",
    "adversary_parameters",
    "colluding_neighbours",
    "default_neighbour_count",
    "default_threshold",
    "neighbour_graph",
    "signature_quorum",
    "split_proof_threshold",
]

COMPLETE_UP_TO = 100  # rounds of at most this many sites use the complete graph
FAILURE_BITS = 40  # a sparse graph's chance that some site has more than m colluding neighbours is at most 2^-40
_SECURE = "privacy.secure_aggregation"


def default_neighbour_count(site_count: int) -> int:
    """The default k = min(K - 1, 2 * ceil(log2 K) + 2): logarithmic in K, and even below K - 1."""
    if site_count < 2:
        raise PrivacyInputError(f"secure aggregation needs at least 2 sites, got {site_count}")
    return min(site_count - 1, 2 * math.ceil(math.log2(site_count)) + 2)


def default_threshold(neighbour_count: int) -> int:
    """The default t = floor(k / 2) + 1: a strict majority of a site's k neighbours (split-proof with no colluder)."""
    return split_proof_threshold(neighbour_count, 0)


def split_proof_threshold(neighbour_count: int, colluding_neighbours: int) -> int:
    """The smallest t with 2t > k + m: a server with m colluding neighbours cannot collect t shares of both secrets."""
    return (neighbour_count + colluding_neighbours) // 2 + 1


def signature_quorum(site_count: int, colluding: int) -> int:
    """The signature quorum floor((K + c) / 2) + 1: only one survivor and advertiser set can gather it."""
    return (site_count + colluding) // 2 + 1


def neighbour_graph(sites: Sequence[int], *, neighbour_count: int, seed: bytes) -> dict[int, frozenset[int]]:
    """Each site's neighbours in H(neighbour_count, K) over the ordering of `sites` that `seed` determines."""
    ordered = sorted(set(sites))
    count = len(ordered)
    if count != len(sites):
        raise PrivacyInputError("sites must be distinct")
    if not 1 <= neighbour_count <= count - 1:
        raise PrivacyInputError(f"neighbour_count must lie in [1, {count - 1}], got {neighbour_count}")
    if neighbour_count == count - 1:
        return {site: frozenset(ordered) - {site} for site in ordered}
    if neighbour_count % 2:
        raise PrivacyInputError(f"a Harary graph below K - 1 neighbours needs an even count, got {neighbour_count}")
    ring = [ordered[i] for i in np.argsort(random_uint64(seed, count), kind="stable")]
    half = neighbour_count // 2
    return {
        site: frozenset(ring[(position + step) % count] for step in range(-half, half + 1) if step)
        for position, site in enumerate(ring)
    }


@cache  # pure in three integers: a site checks a study's terms at every poll, a round's setup at every task
def colluding_neighbours(site_count: int, colluding: int, neighbour_count: int) -> int:
    """m: the most of the c colluders among any one site's k neighbours (beyond it with chance at most 2^-40).

    c itself (at most k) in the complete graph; in a sparse one the smallest m with
    K * P[X > m] <= 2^-FAILURE_BITS, X ~ Hypergeometric(K - 1 others, c colluders, k drawn).
    """
    most = min(colluding, neighbour_count)
    if neighbour_count >= site_count - 1:
        return most
    from scipy.stats import hypergeom  # a sparse graph only (above 100 sites): the CLI's imports stay light

    for count in range(most):
        if site_count * float(hypergeom.sf(count, site_count - 1, colluding, neighbour_count)) <= 2.0**-FAILURE_BITS:
            return count
    return most


@cache
def _sparse_neighbour_count(site_count: int, colluding: int) -> int:
    """The smallest even k from the logarithmic default up with m <= k / 2 (else K - 1: the complete graph)."""
    start = default_neighbour_count(site_count)
    for count in range(start + start % 2, site_count - 1, 2):
        if 2 * colluding_neighbours(site_count, colluding, count) <= count:
            return count
    return site_count - 1


@dataclass(frozen=True)
class SecureParameters:
    """One round's SecAgg+ parameters against a server colluding with up to c sites (see the module's text)."""

    site_count: int  # K
    colluding: int  # c
    neighbour_count: int  # k
    colluding_neighbours: int  # m
    threshold: int  # t
    signature_quorum: int  # q
    min_survivors: int

    @property
    def complete(self) -> bool:
        """Whether every site is every other's neighbour."""
        return self.neighbour_count == self.site_count - 1

    @property
    def dropouts(self) -> int:
        """How many of the round's K sites may drop while its sum is still released."""
        return self.site_count - self.min_survivors

    @property
    def neighbourhood_dropouts(self) -> int:
        """How many of one site's k neighbours may drop while its secrets are still rebuilt."""
        return self.neighbour_count - self.threshold


def adversary_parameters(
    site_count: int, colluding: int, *, neighbour_count: int | None = None, threshold: int | None = None
) -> SecureParameters:
    """The parameters of a round of `site_count` sites against a server colluding with `colluding` sites.

    Explicit `neighbour_count` and `threshold` are taken only when they meet the same bounds; every
    refusal is a SetupError naming the setting.
    """
    if site_count < 2:
        raise SetupError("min_sites", f"secure aggregation needs at least 2 sites in a round, got {site_count}")
    if neighbour_count is not None:
        count = min(neighbour_count, site_count - 1)
    elif site_count <= COMPLETE_UP_TO:
        count = site_count - 1
    else:
        count = _sparse_neighbour_count(site_count, colluding)
    if count != site_count - 1 and count % 2:
        raise SetupError(f"{_SECURE}.neighbour_count", f"neighbour_count {count} must be even (Harary graph)")
    most = colluding_neighbours(site_count, colluding, count)
    least = split_proof_threshold(count, most)
    t = threshold if threshold is not None else least
    _check_threshold(site_count, colluding, count, most, t)
    quorum = signature_quorum(site_count, colluding)
    survivors = max(t + 1, quorum, colluding + 2)
    if survivors > site_count:
        raise SetupError(
            "min_sites",
            f"a round of {site_count} sites cannot release a sum of {survivors} (t + 1 = {t + 1}, "
            f"{quorum} consistency signatures against {colluding} colluding sites, c + 2 = {colluding + 2}): "
            "raise min_sites",
        )
    return SecureParameters(site_count, colluding, count, most, t, quorum, survivors)


def _check_threshold(site_count: int, colluding: int, count: int, most: int, threshold: int) -> None:
    """SetupError unless m < t <= k and 2t > k + m (a lying server splitting the neighbours gets neither secret)."""
    what = "the complete graph" if count == site_count - 1 else f"{count} neighbours"
    least = split_proof_threshold(count, most)
    if least > count:
        setting = "colluding" if count == site_count - 1 else "neighbour_count"
        raise SetupError(
            f"{_SECURE}.{setting}",
            f"{colluding} colluding sites need a threshold of at least {least}, more than the {count} neighbours "
            f"of a site in a round of {site_count} sites: lower colluding or raise min_sites",
        )
    if threshold > count:
        raise SetupError(
            f"{_SECURE}.threshold",
            f"a round of {site_count} sites has {count} neighbours per site; a threshold of {threshold} cannot "
            "exceed it",
        )
    if threshold < least:
        raise SetupError(
            f"{_SECURE}.threshold",
            f"threshold {threshold} with {what} in a round of {site_count} sites lets a coordinator colluding with "
            f"{colluding} sites ({most} of them a site's neighbours) split the honest neighbours and rebuild both of "
            f"a site's secrets: t must be at least floor((k + m) / 2) + 1 = {least}",
        )
