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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shared.errors import PrivacyInputError
from shared.privacy.prg import random_uint64

__all__ = ["default_neighbour_count", "default_threshold", "neighbour_graph"]


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
