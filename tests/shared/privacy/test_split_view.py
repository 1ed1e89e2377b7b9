"""The split-view attack of a lying hub with colluding sites: it unmasked a site under the old thresholds, never now.

The hub tells some of X's honest neighbours "X survived" and the others "X dropped", shows each group
only the signatures of its own story, and adds its colluders' shares (tests/shared/privacy/split_view.py).
Under the thresholds of protocol 5 (t = max(c + 1, floor(k / 2) + 1) or any explicit c + 1 <= t <= k,
t consistency signatures) it rebuilt both of X's secrets whenever 2t <= k + colluders; under
graph.adversary_parameters (2t > k + m, floor((K + c) / 2) + 1 signatures) no configuration the terms
accept lets it, whatever the split, the colluders (0..c) or the threshold.
"""

from __future__ import annotations

import numpy as np
import pytest

from shared.privacy.client import ClientState
from shared.privacy.errors import PrivacyError, SetupError
from shared.privacy.graph import adversary_parameters
from shared.privacy.messages import UnmaskRequest
from shared.privacy.signing import consistency_message
from tests.shared.privacy.split_view import LENGTH, VICTIM, Round, hub_unmasks, signed_setup

SIZES = range(3, 13)


def old_thresholds(sites: int, colluding: int) -> list[int]:
    """Every threshold protocol 5 accepted in the complete graph (its default first)."""
    count = sites - 1
    default = max(colluding + 1, count // 2 + 1)
    return [
        default,
        *(t for t in range(colluding + 1, count + 1) if t != default and max(t + 1, colluding + 2) <= sites),
    ]


def old_round(sites: int, threshold: int, colluding: int) -> Round:
    """A round with protocol 5's parameters: t consistency signatures, max(t + 1, c + 2) survivors."""
    survivors = max(threshold + 1, colluding + 2)
    return Round.run(
        *signed_setup(sites, neighbour_count=sites - 1, threshold=threshold, min_survivors=survivors, quorum=threshold)
    )


def accepted(sites: int, colluding: int, counts: range | list[int] | None = None) -> list[tuple[int, int]]:
    """Every (k, t) the terms accept for a round of `sites` sites against `colluding` (k of `counts`, else K - 1)."""
    found = []
    for count in counts if counts is not None else [sites - 1]:
        for threshold in range(1, count + 1):
            try:
                parameters = adversary_parameters(sites, colluding, neighbour_count=count, threshold=threshold)
            except SetupError:
                continue
            found.append((parameters.neighbour_count, parameters.threshold))
    return found


def new_round(sites: int, colluding: int, count: int, threshold: int) -> Round:
    parameters = adversary_parameters(sites, colluding, neighbour_count=count, threshold=threshold)
    setup = signed_setup(
        sites,
        neighbour_count=parameters.neighbour_count,
        threshold=parameters.threshold,
        min_survivors=parameters.min_survivors,
        quorum=parameters.signature_quorum,
        seed=bytes([sites, colluding, count, threshold]) * 8,
    )
    return Round.run(*setup)


@pytest.mark.parametrize(
    ("sites", "colluding", "threshold", "colluders"),
    [
        (4, 1, 2, 1),  # the default terms at K = 4: one colluding site
        (6, 1, 3, 1),
        (10, 3, 5, 1),  # c = 3 in the terms, yet one colluder is enough
        (7, 2, 3, 2),
        (5, 0, 2, 0),  # an explicit threshold of c + 1 and no colluder at all
        (7, 0, 3, 0),
        (10, 0, 4, 0),
    ],
)
def test_the_old_thresholds_let_the_hub_rebuild_a_site_s_input(
    sites: int, colluding: int, threshold: int, colluders: int
) -> None:
    round_ = old_round(sites, threshold, colluding)
    outcome = hub_unmasks(round_, colluders)
    assert outcome.recovered is not None, outcome
    np.testing.assert_array_equal(outcome.recovered, round_.inputs[VICTIM])
    assert outcome.revealed[1] and outcome.revealed[2]  # both stories were believed by honest sites


def test_the_attack_succeeds_under_the_old_rule_exactly_when_2t_is_at_most_k_plus_the_colluders() -> None:
    exploitable, tried = 0, 0
    for sites in range(3, 9):
        for colluding in range(0, min(3, sites - 2) + 1):
            for threshold in old_thresholds(sites, colluding):
                round_ = old_round(sites, threshold, colluding)
                for colluders in range(colluding + 1):
                    tried += 1
                    outcome = hub_unmasks(round_, colluders)
                    splittable = 2 * threshold <= sites - 1 + colluders
                    assert (outcome.recovered is not None) == splittable, (sites, colluding, threshold, colluders)
                    exploitable += splittable
    assert exploitable > 20 and tried > 60, (exploitable, tried)


@pytest.mark.parametrize("sites", SIZES)
def test_no_configuration_the_terms_accept_lets_the_hub_rebuild_a_site(sites: int) -> None:
    tried = 0
    for colluding in range(0, min(3, sites - 2) + 1):
        for count, threshold in accepted(sites, colluding):
            round_ = new_round(sites, colluding, count, threshold)
            for colluders in range(colluding + 1):
                outcome = hub_unmasks(round_, colluders)
                assert outcome.recovered is None, (sites, colluding, count, threshold, outcome)
                assert min(outcome.self_mask_shares, outcome.mask_key_shares) < threshold, outcome
                assert not (outcome.revealed[1] and outcome.revealed[2]), outcome  # one story at most is believed
                tried += 1
    assert tried >= sites - 1  # every size has accepted configurations, the default among them


@pytest.mark.parametrize("sites", [10, 12])
def test_no_sparse_graph_the_terms_accept_lets_the_hub_rebuild_a_site(sites: int) -> None:
    """Explicit even neighbour counts below K - 1 (colluders placed among X's neighbours first)."""
    tried = 0
    for colluding in (1, 3):
        found = accepted(sites, colluding, range(2, sites - 1, 2))
        for count, threshold in [(k, t) for k, t in found if t in (min(u for j, u in found if j == k), k)]:
            round_ = new_round(sites, colluding, count, threshold)
            outcome = hub_unmasks(round_, colluding)
            assert outcome.recovered is None and min(outcome.self_mask_shares, outcome.mask_key_shares) < threshold
            tried += 1
    assert tried >= 8


@pytest.mark.parametrize(
    ("sites", "colluding", "threshold"),
    [(4, 1, 2), (6, 1, 3), (8, 1, 4), (10, 3, 5), (7, 2, 3), (5, 0, 2), (7, 0, 3), (10, 0, 4), (7, 2, 4)],
)
def test_the_exploitable_thresholds_are_refused(sites: int, colluding: int, threshold: int) -> None:
    with pytest.raises(SetupError, match="split the honest neighbours and rebuild both") as refused:
        adversary_parameters(sites, colluding, threshold=threshold)
    assert refused.value.field == "privacy.secure_aggregation.threshold"


def advertiser_split(sites: int, parameters: tuple[int, int, int, int], hidden: int) -> dict[str, set[int]]:
    """Group 2 (the upper half of the honest sites) is shown every advertisement but `hidden`'s; the last site colludes.

    Returns the honest sites that shared, and those that revealed, by the advertiser set they verified.
    """
    count, threshold, survivors, quorum = parameters
    setup, identities = signed_setup(
        sites, neighbour_count=count, threshold=threshold, min_survivors=survivors, quorum=quorum
    )
    colluder, honest = sites, list(range(1, sites))
    second = set(honest[len(honest) // 2 + 1 :])
    clients = {site: ClientState(setup, site, identity=identities[site]) for site in setup.sites}
    ads = {site: client.advertise(10) for site, client in clients.items()}
    shown = {site: [ad for s, ad in ads.items() if site not in second or s != hidden] for site in setup.sites}
    shared, routed = set(), {site: [] for site in setup.sites}
    for site, client in clients.items():
        try:
            sent = client.share_secrets(shown[site])
        except PrivacyError:
            continue  # too few neighbours in what it was shown
        shared.add(site)
        for share in sent:
            routed[share.receiver].append(share)
    request = UnmaskRequest(frozenset(shared), frozenset())
    digests = {site: clients[site]._advertisers for site in shared}
    signatures: dict[str, dict[int, bytes]] = {}
    for site in sorted(shared - {colluder}):
        opened = [s for s in routed[site] if s.sender in clients[site]._peers and s.sender in shared]
        try:
            clients[site].mask_input(np.zeros(LENGTH, dtype=np.uint64), opened)
            signatures.setdefault(digests[site], {})[site] = clients[site].sign_consistency(request)
        except PrivacyError:
            continue  # too few shares, or too few survivors: it leaves the round
    assert setup.context is not None
    for digest, signed in signatures.items():  # the colluder signs each advertiser set it is shown
        signed[colluder] = identities[colluder].sign(
            consistency_message(setup.context, request.survivors, frozenset(), digest)
        )
    revealed: dict[str, set[int]] = {}
    signers = {site for signed in signatures.values() for site in signed}
    for site in sorted(signers - {colluder}):
        try:
            clients[site].reveal_shares(request, signatures[digests[site]])
        except PrivacyError:
            continue
        revealed.setdefault(digests[site], set()).add(site)
    return {"shared": shared - {colluder}, **revealed}


@pytest.mark.parametrize("sites", [4, 6])
def test_two_groups_shown_different_advertisers_never_both_reveal(sites: int) -> None:
    new = adversary_parameters(sites, 1)
    outcome = advertiser_split(
        sites, (new.neighbour_count, new.threshold, new.min_survivors, new.signature_quorum), hidden=2
    )
    assert len(outcome) <= 2, outcome  # at most one advertiser set was believed (besides "shared")
    old_t = max(2, (sites - 1) // 2 + 1)  # protocol 5: t = max(c + 1, floor(k / 2) + 1), t signatures
    old = advertiser_split(sites, (sites - 1, old_t, max(old_t + 1, 3), old_t), hidden=2)
    assert len(old) == 3, old  # two advertiser sets, each believed by an honest site: different weights unseen
