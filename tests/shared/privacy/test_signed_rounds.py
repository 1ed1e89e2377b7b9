"""A secure round against a malicious server: signed advertisements, one theta^g, a consistency check first."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cardiofl.experiment.secure_simulation import simulate_round
from shared.privacy.client import ClientState
from shared.privacy.errors import BelowThreshold, ProtocolViolation
from shared.privacy.graph import adversary_parameters
from shared.privacy.messages import KeyAdvertisement, RoundSetup, UnmaskRequest
from shared.privacy.server import ServerState
from shared.privacy.signing import RoundContext, SiteIdentity, fingerprint, verify

SITES = (1, 2, 3, 4)
DIGEST = "ab" * 32


def _signed_round(
    digests: dict[int, str] | None = None, attempt: int = 1, colluding: int = 1
) -> tuple[dict[int, SiteIdentity], ServerState, dict[int, ClientState]]:
    """Four sites against `colluding` sites: c = 1 gives t = q = 3 and 4 survivors; c = 0 t = 2, q = 3, 3 survivors."""
    identities = {site: SiteIdentity.generate() for site in SITES}
    keys = {site: identity.public_bytes() for site, identity in identities.items()}
    parameters = adversary_parameters(len(SITES), colluding)

    def setup(digest: str) -> RoundSetup:
        return RoundSetup.create(
            study_uid="u",
            round_no=7,
            sites=SITES,
            graph_seed=bytes(32),
            neighbour_count=parameters.neighbour_count,
            threshold=parameters.threshold,
            min_survivors=parameters.min_survivors,
            quorum=parameters.signature_quorum,
            signing_keys=keys,
            context=RoundContext("u", 3, attempt, digest),
        )

    server = ServerState(setup(DIGEST))
    clients = {
        site: ClientState(setup((digests or {}).get(site, DIGEST)), site, identity=identities[site]) for site in SITES
    }
    return identities, server, clients


def _to_consistency(server: ServerState, clients: dict[int, ClientState]) -> UnmaskRequest:
    for client in clients.values():
        server.receive_advertisement(client.advertise(10, {"entropy": 0.5}))
    ads = server.advertisements()
    for site, client in clients.items():
        server.receive_shares(site, client.share_secrets(ads))
    for site, client in clients.items():
        server.receive_masked_input(client.mask_input(np.full(6, site, dtype=np.uint64), server.shares_for(site)))
    return server.unmask_request()


def test_a_signed_round_sums_exactly_as_an_unsigned_one() -> None:
    rng = np.random.default_rng(1)
    inputs = {site: rng.normal(size=30) for site in SITES}
    weights = dict.fromkeys(SITES, 0.25)
    signed = simulate_round(inputs, weights, signed=True, dropped_after_masking=[4], threshold=2)
    plain = simulate_round(inputs, weights, dropped_after_masking=[4], threshold=2)
    np.testing.assert_array_equal(signed.weighted_sum, plain.weighted_sum)


def test_an_advertisement_not_signed_by_its_sites_key_is_refused_by_server_and_sites() -> None:
    identities, server, clients = _signed_round()
    forged = clients[2].advertise()
    other = SiteIdentity.generate()  # the server's own key, passed off as site 2's
    substituted = replace(forged, signature=other.sign(forged.message(clients[2].setup.context)))
    with pytest.raises(ProtocolViolation, match="not signed"):
        server.receive_advertisement(substituted)
    honest = [client.advertise() for site, client in clients.items() if site != 2]
    with pytest.raises(ProtocolViolation, match="site 2's advertisement is not signed"):
        clients[1].share_secrets([*honest, substituted])


def test_a_replayed_advertisement_of_another_attempt_is_refused() -> None:
    _, _, first = _signed_round(attempt=1)
    identities, server, retry = _signed_round(attempt=2)
    old = first[3].advertise()
    with pytest.raises(ProtocolViolation):
        server.receive_advertisement(old)  # other keys, other attempt: the signature does not hold


def test_sites_that_trained_from_different_models_share_nothing() -> None:
    _, server, clients = _signed_round(digests={3: "cd" * 32})  # the server sent site 3 another theta^g
    ads = [client.advertise() for client in clients.values()]
    with pytest.raises(ProtocolViolation, match="names another theta"):
        server.receive_advertisement(ads[2])
    with pytest.raises(ProtocolViolation, match="different models"):
        clients[1].share_secrets(ads)
    with pytest.raises(ProtocolViolation, match="different models"):
        clients[3].share_secrets(ads)


def test_a_site_whose_own_advertisement_was_dropped_or_altered_shares_nothing() -> None:
    _, server, clients = _signed_round()
    ads = [client.advertise() for client in clients.values()]
    with pytest.raises(ProtocolViolation, match="own advertisement"):
        clients[1].share_secrets(ads[1:])


def test_an_equivocating_server_gets_no_share_that_unmasks_anyone() -> None:
    """Told "site 4 survived" (its self mask) and "site 4 dropped" (its mask key), sites would unmask x_4."""
    _, server, clients = _signed_round(colluding=0)  # three survivors are enough: the lie is a valid request
    request = _to_consistency(server, clients)
    everyone = frozenset(SITES)
    assert request == UnmaskRequest(everyone, frozenset())
    lie = UnmaskRequest(everyone - {4}, frozenset({4}))
    signatures = {1: clients[1].sign_consistency(request), 2: clients[2].sign_consistency(request)}
    signatures[3] = clients[3].sign_consistency(lie)
    with pytest.raises(ProtocolViolation, match="not of the survivor set this site signed"):
        clients[1].reveal_shares(request, signatures)  # site 3's signature is of another set
    with pytest.raises(ProtocolViolation, match="signed another survivor set"):
        clients[3].reveal_shares(request, signatures)
    with pytest.raises(ProtocolViolation, match="two different survivor sets"):
        clients[2].sign_consistency(lie)


def test_fewer_than_the_quorum_of_signatures_reveal_nothing_and_the_server_checks_them_too() -> None:
    _, server, clients = _signed_round()
    request = _to_consistency(server, clients)
    own = clients[1].sign_consistency(request)
    with pytest.raises(ProtocolViolation, match="the quorum is 3"):
        clients[1].reveal_shares(request, {1: own})
    with pytest.raises(ProtocolViolation, match="not of this round's survivor set"):
        server.receive_consistency(2, own)  # site 1's signature passed off as site 2's
    server.receive_consistency(1, own)
    server.receive_consistency(2, clients[2].sign_consistency(request))
    with pytest.raises(BelowThreshold, match="2 consistency signatures, the quorum is 3"):
        server.consistency_signatures()  # the server, checking as the sites do, does not open phase 4 either
    server.receive_consistency(3, clients[3].sign_consistency(request))
    reveal = clients[1].reveal_shares(request, server.consistency_signatures())
    assert set(reveal.self_mask_shares) <= set(SITES) and not reveal.mask_key_shares


def test_signatures_and_fingerprints() -> None:
    identity = SiteIdentity.generate()
    signature = identity.sign(b"m")
    assert verify(identity.public_bytes(), b"m", signature)
    assert not verify(identity.public_bytes(), b"n", signature)
    assert not verify(SiteIdentity.generate().public_bytes(), b"m", signature)
    again = SiteIdentity.from_private_bytes(identity.private_bytes())
    assert again.public_hex() == identity.public_hex() and len(fingerprint(identity.public_hex())) == 16
    assert isinstance(KeyAdvertisement(1, b"", b"").report, dict)
