import pytest

from shared.privacy.graph import (
    default_neighbour_count,
    default_threshold,
    neighbour_graph,
)


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
