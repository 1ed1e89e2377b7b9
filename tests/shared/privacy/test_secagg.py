import numpy as np
import pytest

from cardiofl.experiment.secure_simulation import simulate_round, simulate_secure_sum
from shared.privacy.client import ClientState
from shared.privacy.errors import BelowThreshold, NotEnoughShares, ProtocolViolation, ShareDecryptionFailed
from shared.privacy.messages import EncryptedShare, RoundSetup, UnmaskRequest
from shared.privacy.quantize import COUNTS, FixedPoint
from shared.privacy.server import ServerState


def _inputs(sites: int, length: int = 2000, seed: int = 0) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    rng = np.random.default_rng(seed)
    inputs = {site: rng.normal(scale=0.5, size=length) for site in range(1, sites + 1)}
    weights = {site: float(rng.integers(100, 5000)) / 10_000 for site in inputs}
    return inputs, weights


def _plain_weighted_sum(inputs: dict[int, np.ndarray], weights: dict[int, float], sites: frozenset[int]) -> np.ndarray:
    return np.sum([weights[site] * inputs[site] for site in sites], axis=0)


@pytest.mark.parametrize(
    "drops",
    [
        {},
        {"dropped_after_advertise": [2]},
        {"dropped_after_sharing": [4]},
        {"dropped_after_masking": [5]},
        {"dropped_after_advertise": [1], "dropped_after_sharing": [6]},
    ],
    ids=["no-dropout", "after-advertise", "after-sharing", "after-masking", "two-phases"],
)
def test_secure_weighted_sum_equals_the_plain_sum_within_the_quantisation_bound(drops: dict[str, list[int]]) -> None:
    inputs, weights = _inputs(sites=7)
    result = simulate_round(inputs, weights, **drops)  # type: ignore[arg-type]
    gone = set(drops.get("dropped_after_advertise", [])) | set(drops.get("dropped_after_sharing", []))
    assert result.survivors == frozenset(inputs) - gone  # a site dropped after masking is still in the sum
    expected = _plain_weighted_sum(inputs, weights, result.survivors)
    assert result.error_bound == len(result.survivors) * 2.0**-25
    assert np.abs(result.weighted_sum - expected).max() <= result.error_bound


def test_sparse_neighbour_graph_with_dropouts_still_sums_exactly() -> None:
    inputs, weights = _inputs(sites=14, length=300, seed=1)
    setup = RoundSetup.create(study_uid="s", round_no=1, sites=list(inputs), graph_seed=b"g" * 32)
    assert setup.neighbour_count == 10 < 13  # SecAgg+: fewer neighbours than sites
    result = simulate_round(
        inputs, weights, graph_seed=b"g" * 32, dropped_after_sharing=[3, 8], dropped_after_advertise=[11]
    )
    assert result.survivors == frozenset(inputs) - {3, 8, 11}
    expected = _plain_weighted_sum(inputs, weights, result.survivors)
    assert np.abs(result.weighted_sum - expected).max() <= result.error_bound


def test_integer_statistics_sum_exactly_alongside_model_values() -> None:
    rng = np.random.default_rng(2)
    counts = {site: rng.integers(0, 10_000, size=50) for site in range(1, 6)}
    values = {site: rng.normal(size=100) for site in counts}
    encoding = FixedPoint()
    ring = {
        site: np.concatenate([encoding.encode(values[site]), COUNTS.encode_counts(counts[site])]) for site in counts
    }
    result = simulate_secure_sum(ring, dropped_after_sharing=[2])
    survivors = sorted(result.survivors)
    assert (
        COUNTS.decode_counts(result.ring_sum[100:]).tolist() == np.sum([counts[s] for s in survivors], axis=0).tolist()
    )
    decoded = encoding.decode(result.ring_sum[:100])
    assert np.abs(decoded - np.sum([values[s] for s in survivors], axis=0)).max() <= encoding.error_bound(4)


def test_too_many_silent_survivors_fail_with_not_enough_shares() -> None:
    inputs, weights = _inputs(sites=5, length=10)  # complete graph: k = 4, t = 3
    with pytest.raises(NotEnoughShares):
        simulate_round(inputs, weights, dropped_after_masking=[1, 2, 3])


def test_too_few_inputs_fail_below_threshold() -> None:
    inputs, weights = _inputs(sites=5, length=10)
    with pytest.raises(BelowThreshold):
        simulate_round(inputs, weights, dropped_after_sharing=[1, 2, 3], threshold=2, min_survivors=3)


def test_too_few_sharing_neighbours_fail_below_threshold() -> None:
    inputs, weights = _inputs(sites=5, length=10)
    with pytest.raises(BelowThreshold):
        simulate_round(inputs, weights, dropped_after_advertise=[1, 2])


def _round_to_masking(sites: int = 5) -> tuple[RoundSetup, ServerState, dict[int, ClientState]]:
    setup = RoundSetup.create(study_uid="s", round_no=2, sites=range(1, sites + 1), graph_seed=bytes(32))
    server = ServerState(setup)
    clients = {site: ClientState(setup, site) for site in setup.sites}
    for client in clients.values():
        server.receive_advertisement(client.advertise())
    relayed = server.advertisements()
    for site, client in clients.items():
        server.receive_shares(site, client.share_secrets(relayed))
    return setup, server, clients


def test_client_refuses_a_share_rerouted_by_the_server() -> None:
    _, server, clients = _round_to_masking()
    to_two = server.shares_for(2)
    forged = [EncryptedShare(s.sender, 3, s.ciphertext) for s in to_two]  # addressed to 2, handed to 3
    with pytest.raises(ShareDecryptionFailed):
        clients[3].mask_input(np.zeros(4, dtype=np.uint64), forged)


def test_client_refuses_requests_that_would_unmask_an_input() -> None:
    _, server, clients = _round_to_masking()
    clients[1].mask_input(np.zeros(4, dtype=np.uint64), server.shares_for(1))
    everyone = frozenset(range(1, 6))
    with pytest.raises(ProtocolViolation):  # site 2 both survived and dropped: b_2 and s_2 would leak x_2
        clients[1].reveal_shares(UnmaskRequest(everyone, frozenset({2})))
    with pytest.raises(BelowThreshold):  # a "sum" of too few inputs
        clients[1].reveal_shares(UnmaskRequest(frozenset({1}), everyone - {1}))
    first = clients[1].reveal_shares(UnmaskRequest(everyone - {2}, frozenset({2})))
    assert set(first.mask_key_shares) == {2} and set(first.self_mask_shares) == {3, 4, 5}
    with pytest.raises(ProtocolViolation):  # asking again, now for site 2's self mask
        clients[1].reveal_shares(UnmaskRequest(everyone, frozenset()))


def test_server_refuses_messages_out_of_phase() -> None:
    setup, server, clients = _round_to_masking()
    with pytest.raises(ProtocolViolation):
        server.receive_advertisement(ClientState(setup, 1).advertise())
    server.receive_masked_input(clients[1].mask_input(np.zeros(4, dtype=np.uint64), server.shares_for(1)))
    with pytest.raises(ProtocolViolation):
        server.receive_masked_input(clients[1].mask_input(np.zeros(4, dtype=np.uint64), server.shares_for(1)))


def test_masked_inputs_reveal_nothing_about_the_input() -> None:
    _, server, clients = _round_to_masking()
    values = np.sin(np.linspace(0, 40, 100_000)) * 5
    masked = clients[4].mask_input(FixedPoint().encode(values), server.shares_for(4)).vector
    assert abs(np.corrcoef(values, masked.view(np.int64).astype(np.float64))[0, 1]) < 0.01
