"""A lying hub's split-view attack on one site X, through the project's own ClientStates (tests' helper).

The hub relays phases 0-2 honestly, then tells X's honest neighbours two stories: group 1 (and X,
and any honest non-neighbour it places there) that X survived, group 2 that X dropped. Each
honest site signs the one story it was told and is shown only the signatures of that story; the
colluding sites sign both stories and hand the hub the shares of X's secrets they hold. Group 1
reveals self-mask shares of the survivors (X among them), group 2 mask-key shares of the dropped
(X). With t shares of both secrets the hub removes every mask from X's masked input: X's input.

`hub_unmasks` plays the splits of X's honest neighbours that can serve the hub best (group 1 or
group 2 just large enough for t shares with the colluders', or the two halves; the honest
non-neighbours go to story 1 until it has its quorum of signers, the rest to story 2) on copies of
the clients after phase 2, and returns the best the hub got.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np

from shared.privacy.client import ClientState
from shared.privacy.errors import NotEnoughShares, PrivacyError
from shared.privacy.keys import mask_seed, private_key_from_bytes
from shared.privacy.masking import apply_masks, pairwise_sign
from shared.privacy.messages import EncryptedShare, KeyAdvertisement, MaskedInput, RoundSetup, UnmaskRequest
from shared.privacy.shamir import Share, reconstruct_secret
from shared.privacy.signing import RoundContext, SiteIdentity, advertisers_digest, consistency_message

__all__ = ["Attack", "Outcome", "Round", "hub_unmasks", "signed_setup"]

VICTIM = 1
LENGTH = 5  # ring words of every site's input


def signed_setup(
    sites: int, *, neighbour_count: int, threshold: int, min_survivors: int, quorum: int, seed: bytes = bytes(32)
) -> tuple[RoundSetup, dict[int, SiteIdentity]]:
    """A signed round of sites 1..K with the given parameters, and every site's signing identity."""
    identities = {site: SiteIdentity.generate() for site in range(1, sites + 1)}
    setup = RoundSetup(
        study_uid="split-view",
        round_no=9,
        sites=tuple(identities),
        graph_seed=seed,
        neighbour_count=neighbour_count,
        threshold=threshold,
        min_survivors=min_survivors,
        signature_quorum=quorum,
        signing_keys={site: identity.public_bytes() for site, identity in identities.items()},
        context=RoundContext("split-view", 1, 1, "ab" * 32),
    )
    return setup, identities


@dataclass
class Round:
    """A signed round run honestly through phase 2: every client's state, X's masked input, every true input."""

    setup: RoundSetup
    identities: dict[int, SiteIdentity]
    clients: dict[int, ClientState]
    advertisements: list[KeyAdvertisement]
    inputs: dict[int, np.ndarray]
    masked: dict[int, MaskedInput]

    @classmethod
    def run(cls, setup: RoundSetup, identities: dict[int, SiteIdentity]) -> Round:
        """Phases 0-2 with every message relayed as sent."""
        rng = np.random.default_rng(7)
        clients = {site: ClientState(setup, site, identity=identities[site]) for site in setup.sites}
        ads = [client.advertise(10 + site) for site, client in clients.items()]
        routed: dict[int, list[EncryptedShare]] = {site: [] for site in setup.sites}
        for client in clients.values():
            for share in client.share_secrets(ads):
                routed[share.receiver].append(share)
        inputs = {site: rng.integers(0, 2**63, LENGTH, dtype=np.uint64) for site in setup.sites}
        masked = {site: clients[site].mask_input(inputs[site], routed[site]) for site in setup.sites}
        return cls(setup, identities, clients, ads, inputs, masked)


@dataclass(frozen=True)
class Attack:
    """Who sits where: the colluders, and how many of X's honest neighbours (and non-neighbours) hear story 1."""

    colluders: frozenset[int]
    first_neighbours: int
    first_others: int = 0


@dataclass
class Outcome:
    """What the hub got of X in one attack: shares of each secret, who revealed, X's input if rebuilt."""

    attack: Attack
    self_mask_shares: int
    mask_key_shares: int
    revealed: dict[int, list[int]]  # story (1, 2) -> honest sites that revealed
    recovered: np.ndarray | None


def _stories(setup: RoundSetup) -> dict[int, UnmaskRequest]:
    everyone = frozenset(setup.sites)
    return {1: UnmaskRequest(everyone, frozenset()), 2: UnmaskRequest(everyone - {VICTIM}, frozenset({VICTIM}))}


def _groups(round_: Round, attack: Attack) -> dict[int, list[int]]:
    """Honest sites by the story they are told (X hears story 1: it survived)."""
    neighbours = sorted(round_.setup.neighbours(VICTIM) - attack.colluders)
    others = sorted(set(round_.setup.sites) - round_.setup.neighbours(VICTIM) - attack.colluders - {VICTIM})
    return {
        1: [VICTIM, *neighbours[: attack.first_neighbours], *others[: attack.first_others]],
        2: [*neighbours[attack.first_neighbours :], *others[attack.first_others :]],
    }


def _consistency(round_: Round, attack: Attack) -> Outcome:
    """Phases 3-4 under the attack, on copies of the clients; the shares of X's secrets the hub ends with."""
    clients = {site: copy.copy(client) for site, client in round_.clients.items()}  # phases 3-4 rebind, never mutate
    context, stories = round_.setup.context, _stories(round_.setup)
    assert context is not None
    digest = advertisers_digest([(ad.site, ad.num_examples, ad.report) for ad in round_.advertisements])
    groups = _groups(round_, attack)
    signatures: dict[int, dict[int, bytes]] = {1: {}, 2: {}}
    for story, request in stories.items():
        message = consistency_message(context, request.survivors, request.dropped, digest)
        for colluder in attack.colluders:  # colluders sign whatever the hub asks
            signatures[story][colluder] = round_.identities[colluder].sign(message)
        for site in groups[story]:
            try:
                signatures[story][site] = clients[site].sign_consistency(request)
            except PrivacyError:
                pass  # e.g. too few survivors in the story: it signs nothing
    shares: dict[str, list[Share]] = {"self_mask_shares": [], "mask_key_shares": []}
    for colluder in attack.colluders:
        held = clients[colluder]._held[VICTIM]
        shares["self_mask_shares"].append(Share(colluder, held.self_mask_share))
        shares["mask_key_shares"].append(Share(colluder, held.mask_key_share))
    revealed: dict[int, list[int]] = {1: [], 2: []}
    for story, request in stories.items():
        for site in groups[story]:
            if site == VICTIM or site not in signatures[story]:
                continue
            try:
                reveal = clients[site].reveal_shares(request, signatures[story])
            except PrivacyError:
                continue
            revealed[story].append(site)
            for kind in shares:
                if VICTIM in getattr(reveal, kind):
                    shares[kind].append(getattr(reveal, kind)[VICTIM])
    return _unmask(round_, attack, shares, revealed)


def _unmask(round_: Round, attack: Attack, shares: dict[str, list[Share]], revealed: dict[int, list[int]]) -> Outcome:
    """X's input, when the hub holds t shares of both of X's secrets; else None."""
    threshold, recovered = round_.setup.threshold, None
    try:
        self_seed = reconstruct_secret(shares["self_mask_shares"], threshold=threshold)
        mask_key = private_key_from_bytes(reconstruct_secret(shares["mask_key_shares"], threshold=threshold))
    except NotEnoughShares:
        pass
    else:
        masks = [(self_seed, -1)]
        for peer in sorted(round_.clients[VICTIM]._held):
            public = next(ad.mask_public for ad in round_.advertisements if ad.site == peer)
            seed = mask_seed(
                mask_key, public, study_uid=round_.setup.study_uid, round_no=round_.setup.round_no, sites=(VICTIM, peer)
            )
            masks.append((seed, -pairwise_sign(VICTIM, peer)))
        vector = round_.masked[VICTIM].vector
        assert isinstance(vector, np.ndarray)
        recovered = apply_masks(vector.copy(), masks)
    counts = (len(shares["self_mask_shares"]), len(shares["mask_key_shares"]))
    return Outcome(attack, *counts, revealed, recovered)


def _attacks(round_: Round, colluders: frozenset[int]) -> Iterator[Attack]:
    """The splits worth trying: either group just large enough for t shares, or the halves."""
    setup, held = round_.setup, len(colluders & round_.setup.neighbours(VICTIM))
    honest = len(setup.neighbours(VICTIM) - colluders)
    others = len(set(setup.sites) - setup.neighbours(VICTIM) - colluders - {VICTIM})
    needed = setup.threshold - held
    for first in sorted({needed, honest - needed, honest // 2, (honest + 1) // 2} & set(range(honest + 1))):
        signers = 1 + first + len(colluders)  # story 1's: X, group 1, the colluders
        yield Attack(colluders, first, min(others, max(0, setup.signature_quorum - signers)))


def hub_unmasks(round_: Round, colluding: int, *, colluders: Collection[int] | None = None) -> Outcome:
    """The best the hub gets with `colluding` colluders (X's neighbours first), over every split of the rest.

    The first outcome that rebuilt X's input, else the one with the most shares of the scarcer secret.
    """
    if colluders is None:
        order = [*sorted(round_.setup.neighbours(VICTIM)), *sorted(set(round_.setup.sites) - {VICTIM})]
        colluders = list(dict.fromkeys(order))[:colluding]
    best: Outcome | None = None
    for attack in _attacks(round_, frozenset(colluders)):
        outcome = _consistency(round_, attack)
        if outcome.recovered is not None:
            return outcome
        if best is None or min(outcome.self_mask_shares, outcome.mask_key_shares) > min(
            best.self_mask_shares, best.mask_key_shares
        ):
            best = outcome
    assert best is not None
    return best
