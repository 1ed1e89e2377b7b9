"""The SecAgg+ neighbour graph and its parameters (Bell et al., CCS 2020, on Bonawitz et al., CCS 2017).

In SecAgg+ a site agrees masks with, and Shamir-shares its secrets among, only its k neighbours
in a sparse graph instead of all K - 1 other sites, so each site's work and messages grow with k
rather than K. The graph is a Harary graph H(k, K) (the K sites on a ring, each joined to the k/2
nearest on either side) over a pseudorandom ordering of the sites, derived from a public
per-round seed so that every site and the server compute the same graph, and no one chooses it.
Bell et al. show that k = O(log K) neighbours and a threshold t chosen between the expected
number of corrupt and of surviving neighbours suffice for constant dropout and corruption rates.

Defaults (simple and conservative, not Bell et al.'s optimised constants):

* k = min(K - 1, 2 * ceil(log2 K) + 2): even, so H(k, K) is well defined; up to K = 10 the graph
  is complete and the protocol is Bonawitz et al.'s SecAgg (k = K - 1).
* t = floor(k / 2) + 1, a strict majority of a site's neighbours: the sum is recovered while every
  site keeps at least t neighbours to the end (fewer than k/2 of them drop), and a server that
  colludes with fewer than t of a site's neighbours learns nothing of that site's masks.
* min_survivors = t + 1 (at most K): the server unmasks no sum of fewer inputs (clients refuse to
  reveal shares for a smaller sum). A survivor's self-mask seed is rebuilt from the shares its
  other surviving neighbours hold (a site holds no share of its own secrets), so with fewer than
  t + 1 survivors no sum could be unmasked; it is also the divisor of the distributed DP noise.

Pass `neighbour_count` and `threshold` explicitly for other dropout or corruption regimes.

Against a stated adversary (`adversary_parameters`: a server colluding with up to c sites) the
choice is made from c instead. Up to COMPLETE_UP_TO sites a round's graph is complete (every site
shares with every other: no sparse graph meets a useful bound that small) and t >= c + 1, so the
server and its c colluders together never hold t shares of an honest site's secret, whatever the
graph. Above it the graph is Harary over k neighbours chosen so that, the c colluders placed
anywhere, the chance that some site has t or more of them among its neighbours is at most
2^-FAILURE_BITS (a union bound over the sites of the hypergeometric tail: a site's k neighbours
are a uniform draw from the K - 1 others, since the ordering comes from a seed no one chooses).
In both, a released sum holds at least c + 2 inputs (min_survivors >= c + 2), so the server and
its colluders, subtracting their own, are left with a sum of at least two honest sites.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.stats import hypergeom

from shared.errors import PrivacyInputError
from shared.privacy.errors import SetupError
from shared.privacy.prg import random_uint64

__all__ = [
    "COMPLETE_UP_TO",
    "FAILURE_BITS",
    "adversary_parameters",
    "collusion_failure",
    "default_neighbour_count",
    "default_threshold",
    "neighbour_graph",
]

COMPLETE_UP_TO = 100  # rounds of at most this many sites use the complete graph
FAILURE_BITS = 40  # a sparse graph's chance that some site has t colluding neighbours is at most 2^-40
_SECURE = "privacy.secure_aggregation"


def default_neighbour_count(site_count: int) -> int:
    """The default k = min(K - 1, 2 * ceil(log2 K) + 2): logarithmic in K, and even below K - 1."""
    if site_count < 2:
        raise PrivacyInputError(f"secure aggregation needs at least 2 sites, got {site_count}")
    return min(site_count - 1, 2 * math.ceil(math.log2(site_count)) + 2)


def default_threshold(neighbour_count: int) -> int:
    """The default t = floor(k / 2) + 1: a strict majority of a site's k neighbours."""
    return neighbour_count // 2 + 1


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


def collusion_failure(site_count: int, colluding: int, neighbour_count: int, threshold: int) -> float:
    """An upper bound on the chance that some site has >= t of the c colluders among its k neighbours.

    Union bound over the K sites of P[X >= t], X ~ Hypergeometric(K - 1 others, c colluders, k drawn).
    """
    if threshold > colluding:
        return 0.0
    tail = float(hypergeom.sf(threshold - 1, site_count - 1, colluding, neighbour_count))
    return min(1.0, site_count * tail)


def _sparse_neighbour_count(site_count: int, colluding: int) -> int:
    """The smallest even k whose strict-majority threshold meets the 2^-FAILURE_BITS bound (else K - 1)."""
    for count in range(2, site_count - 1, 2):
        if collusion_failure(site_count, colluding, count, count // 2 + 1) <= 2.0**-FAILURE_BITS:
            return count
    return site_count - 1


def adversary_parameters(
    site_count: int, colluding: int, *, neighbour_count: int | None = None, threshold: int | None = None
) -> tuple[int, int, int]:
    """(k, t, min_survivors) of a round of `site_count` sites against a server colluding with `colluding` sites.

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
    complete = count == site_count - 1
    if not complete and count % 2:
        raise SetupError(f"{_SECURE}.neighbour_count", f"neighbour_count {count} must be even (Harary graph)")
    t = threshold if threshold is not None else max(colluding + 1, count // 2 + 1) if complete else count // 2 + 1
    if threshold is None and t > count:  # c alone asks for more shares than a site has neighbours
        raise SetupError(
            f"{_SECURE}.colluding",
            f"{colluding} colluding sites need a threshold of at least {colluding + 1}, more than the {count} "
            f"neighbours of a site in a round of {site_count} sites: lower colluding or raise min_sites",
        )
    if not 1 <= t <= count:
        raise SetupError(
            f"{_SECURE}.threshold",
            f"a round of {site_count} sites has {count} neighbours per site; a threshold of {t} "
            + ("cannot exceed it" if t > count else "must be at least 1")
            + (f" (t >= c + 1 = {colluding + 1} against {colluding} colluding sites)" if t > count else ""),
        )
    if collusion_failure(site_count, colluding, count, t) > 2.0**-FAILURE_BITS:
        what = "the complete graph" if complete else f"{count} neighbours"
        raise SetupError(
            f"{_SECURE}.threshold",
            f"threshold {t} with {what} in a round of {site_count} sites lets {colluding} colluding sites hold t "
            f"shares of a site's secrets (t must be at least {colluding + 1}, or the graph sparse and large enough)",
        )
    survivors = max(t + 1, colluding + 2)
    if survivors > site_count:
        raise SetupError(
            "min_sites",
            f"a round of {site_count} sites cannot release a sum of {survivors} (t + 1 = {t + 1}, and c + 2 = "
            f"{colluding + 2} so that {colluding} colluding sites never face a single honest input): raise min_sites",
        )
    return count, t, survivors
