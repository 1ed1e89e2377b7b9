"""The SecAgg+ neighbour graph, and the parameters a lying server with colluding sites cannot split."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.privacy.errors import SetupError
from shared.privacy.graph import (
    COMPLETE_UP_TO,
    FAILURE_BITS,
    adversary_parameters,
    default_neighbour_count,
    default_threshold,
    neighbour_graph,
)
from shared.study.checks import check_study, checked_terms
from shared.study.secure_setup import colluding_sites, round_parameters
from shared.terms import StudyTerms, TermsError


@pytest.mark.parametrize(
    ("sites", "neighbours", "threshold"),
    [(2, 1, 1), (5, 4, 3), (10, 9, 5), (11, 10, 6), (16, 10, 6), (100, 16, 9), (1000, 22, 12)],
)
def test_default_parameters_grow_logarithmically(sites: int, neighbours: int, threshold: int) -> None:
    assert default_neighbour_count(sites) == neighbours
    assert default_threshold(neighbours) == threshold


def test_neighbour_graph_is_symmetric_regular_and_follows_the_seed() -> None:
    sites = list(range(1, 41))
    graph = neighbour_graph(sites, neighbour_count=12, seed=b"a" * 32)
    assert set(graph) == set(sites)
    assert all(len(neighbours) == 12 and site not in neighbours for site, neighbours in graph.items())
    assert all(site in graph[peer] for site, neighbours in graph.items() for peer in neighbours)
    assert graph == neighbour_graph(list(reversed(sites)), neighbour_count=12, seed=b"a" * 32)
    assert graph != neighbour_graph(sites, neighbour_count=12, seed=b"b" * 32)


def test_neighbour_graph_with_k_equal_k_minus_one_is_complete() -> None:
    graph = neighbour_graph([4, 7, 9], neighbour_count=2, seed=bytes(32))
    assert graph == {4: {7, 9}, 7: {4, 9}, 9: {4, 7}}


@pytest.mark.parametrize(("count", "neighbours"), [(10, 3), (10, 10), (10, 0)])
def test_neighbour_graph_rejects_impossible_degrees(count: int, neighbours: int) -> None:
    with pytest.raises(ValueError):
        neighbour_graph(list(range(1, count + 1)), neighbour_count=neighbours, seed=bytes(32))


# -- parameters against a lying server colluding with c sites (graph.adversary_parameters) --------------


def exact_colluding_neighbours(sites: int, colluding: int, count: int) -> int:
    """The colluders m by exact arithmetic: the smallest m with K * P[X > m] <= 2^-40, X ~ Hypergeom(K - 1, c, k)."""
    most = min(colluding, count)
    if count >= sites - 1:
        return most
    total = math.comb(sites - 1, count)
    for m in range(most):
        tail = sum(
            math.comb(colluding, j) * math.comb(sites - 1 - colluding, count - j) for j in range(m + 1, most + 1)
        )
        if Fraction(sites * tail, total) <= Fraction(1, 2**FAILURE_BITS):
            return m
    return most


def conditions(sites: int, colluding: int, count: int, threshold: int) -> bool:
    """Whether (k, t) meets every bound the module states, for a round of K sites against c (hand-derived)."""
    m = exact_colluding_neighbours(sites, colluding, count)
    quorum = (sites + colluding) // 2 + 1
    return 2 * threshold > count + m and threshold <= count and max(threshold + 1, quorum, colluding + 2) <= sites


@settings(max_examples=300, deadline=None)
@given(
    sites=st.integers(2, 260),
    colluding=st.integers(0, 90),
    count=st.one_of(st.none(), st.integers(1, 259)),
    threshold=st.one_of(st.none(), st.integers(1, 260)),
)
def test_accepted_parameters_are_split_proof_and_refused_ones_break_a_bound(
    sites: int, colluding: int, count: int | None, threshold: int | None
) -> None:
    colluding = min(colluding, sites - 1)
    try:
        p = adversary_parameters(sites, colluding, neighbour_count=count, threshold=threshold)
    except SetupError:
        if count is not None and threshold is not None:
            k = min(count, sites - 1)
            assert (k != sites - 1 and k % 2) or not conditions(sites, colluding, k, threshold)
        return
    k, t, m, q = p.neighbour_count, p.threshold, p.colluding_neighbours, p.signature_quorum
    assert m == exact_colluding_neighbours(sites, colluding, k)
    assert conditions(sites, colluding, k, t)
    # no split of a site's k - m honest neighbours gives the hub t shares of both its secrets
    assert not any(g1 + m >= t and (k - m - g1) + m >= t for g1 in range(k - m + 1))
    assert t > m and 2 * q > sites + colluding  # the colluders alone hold < t shares; two stories cannot both gather q
    assert p.min_survivors == max(t + 1, q, colluding + 2) <= sites and p.dropouts == sites - p.min_survivors
    if threshold is None:
        assert t == (k + m) // 2 + 1  # the smallest split-proof threshold
    if count is None:
        assert k == sites - 1 if sites <= COMPLETE_UP_TO else (k % 2 == 0 or k == sites - 1)


@pytest.mark.parametrize(
    ("sites", "colluding", "expected"),
    [
        (4, 1, (3, 3, 3, 4, 0)),  # 1 dropout under protocol 5
        (6, 1, (5, 4, 4, 5, 1)),  # 2
        (8, 1, (7, 5, 5, 6, 2)),  # 3
        (7, 2, (6, 5, 5, 6, 1)),  # the default c = 2: 2
        (10, 3, (9, 7, 7, 8, 2)),  # the default c = 3: 4
        (4, 0, (3, 2, 3, 3, 1)),
        (200, 66, (128, 97, 134, 134, 66)),  # sparse: 64 of the 66 colluders among a site's 128 neighbours
        (200, 1, (18, 10, 101, 101, 99)),
    ],
)
def test_the_documented_parameters(sites: int, colluding: int, expected: tuple[int, int, int, int, int]) -> None:
    p = adversary_parameters(sites, colluding)
    assert (p.neighbour_count, p.threshold, p.signature_quorum, p.min_survivors, p.dropouts) == expected


@pytest.mark.parametrize("sites", range(3, 13))
def test_the_default_terms_are_accepted_at_every_size_from_3_to_12(sites: int) -> None:
    names = [f"site-{i:02d}" for i in range(sites)]
    for min_sites in (2, sites):
        terms = StudyTerms.model_validate(
            {"sites": names, "min_sites": min_sites, "privacy": {"secure_aggregation": {}}}
        )
        parameters = round_parameters(terms.privacy.secure_aggregation, sites, colluding_sites(terms))
        assert parameters.complete and parameters.colluding == (sites - 1) // 3


@pytest.mark.parametrize(
    ("sites", "secure", "setting"),
    [
        (5, {"threshold": 2, "colluding": 0}, "threshold"),  # exploitable with no colluder under protocol 5
        (7, {"threshold": 3}, "threshold"),
        (10, {"threshold": 4}, "threshold"),
        (4, {"threshold": 2}, "threshold"),  # the default c = 1
        (4, {"colluding": 3}, "colluding"),  # fewer than two honest sites
        (12, {"neighbour_count": 4, "threshold": 2, "colluding": 1}, "threshold"),  # sparse, 2t <= k + m
    ],
)
def test_terms_that_let_a_lying_hub_split_the_neighbours_are_unreadable(
    sites: int, secure: dict[str, int], setting: str
) -> None:
    names = [f"site-{i:02d}" for i in range(sites)]
    terms = StudyTerms.model_validate({"sites": names, "min_sites": sites, "privacy": {"secure_aggregation": secure}})
    (problem,) = check_study(terms)  # the data is well formed; the rule above it refuses the study
    assert problem.path == ("privacy", "secure_aggregation", setting), problem
    with pytest.raises(TermsError, match=f"privacy.secure_aggregation.{setting}: "):
        checked_terms(terms)
