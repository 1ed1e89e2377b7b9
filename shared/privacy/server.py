"""The server's side of one SecAgg+ round: relay keys and shares, collect masked inputs, unmask the sum.

The server sees public keys, ciphertexts it cannot open, masked vectors, and the shares survivors
reveal: self-mask seeds of survivors and mask keys of sites that dropped after sharing. With
them it removes the survivors' self masks and the pairwise masks between survivors and dropped
sites; the masks between two survivors cancel in the sum. It learns the sum of the survivors'
ring vectors and nothing else about any one of them. In a signed round (RoundSetup.signing_keys)
it checks, as every site does, each advertisement's signature and theta^g digest and each
survivor's consistency signature, so an honest server refuses what the sites would refuse.

A server that keeps the masked vectors elsewhere (the coordinator sums stored blobs one at a time)
records only who sent one (`note_masked_input`) and unmasks its own total (`unmask`).

Each receive/relay method belongs to one phase; asking for the next phase's messages closes the
current one, so the sets of sites that advertised, shared and sent inputs are fixed once relayed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from shared.errors import PrivacyInputError
from shared.privacy.errors import BelowThreshold, NotEnoughShares, ProtocolViolation
from shared.privacy.keys import mask_seed, private_key_from_bytes
from shared.privacy.masking import RingVector, SignedSeed, apply_masks, pairwise_sign, ring_shape, sum_rings
from shared.privacy.messages import (
    EncryptedShare,
    KeyAdvertisement,
    MaskedInput,
    RoundSetup,
    ShareReveal,
    UnmaskRequest,
)
from shared.privacy.shamir import Share, reconstruct_secret
from shared.privacy.signing import advertisers_digest, consistency_message, verify

__all__ = ["Phase", "ServerState"]


class Phase(enum.IntEnum):
    """The phases of a round, in order."""

    ADVERTISING = 0
    SHARING = 1
    MASKING = 2
    CONSISTENCY = 3
    UNMASKING = 4


class ServerState:
    """Everything the server holds for one round; methods are named after the phase they serve."""

    def __init__(self, setup: RoundSetup) -> None:
        self.setup = setup
        self.phase = Phase.ADVERTISING
        self._advertisements: dict[int, KeyAdvertisement] = {}
        self._shares_to: dict[int, list[EncryptedShare]] = {}  # receiver -> ciphertexts addressed to it
        self._shared: set[int] = set()  # sites that sent their shares
        self._inputs: dict[int, RingVector] = {}
        self._input_sites: set[int] = set()  # sites whose masked input is in the sum (held here or elsewhere)
        self._request: UnmaskRequest | None = None
        self._signatures: dict[int, bytes] = {}  # survivor -> its consistency signature
        self._reveals: dict[int, ShareReveal] = {}

    def receive_advertisement(self, advertisement: KeyAdvertisement) -> None:
        """Phase 0: record one site's public keys."""
        self._require(Phase.ADVERTISING, "advertisement")
        self._require_site(advertisement.site)
        if advertisement.site in self._advertisements:
            raise ProtocolViolation(f"site {advertisement.site} advertised twice")
        context = self.setup.context
        if self.setup.signed:
            assert context is not None
            key = self.setup.signing_keys[advertisement.site]
            if not verify(key, advertisement.message(context), advertisement.signature):
                raise ProtocolViolation(f"site {advertisement.site}'s advertisement is not signed by its signing key")
            if advertisement.global_digest != context.global_digest:
                raise ProtocolViolation(f"site {advertisement.site}'s advertisement names another theta^g")
        self._advertisements[advertisement.site] = advertisement

    def advertisements(self) -> list[KeyAdvertisement]:
        """Phase 1 (closes phase 0): every advertisement, to relay to every advertiser (the weights read them all)."""
        self._advance(Phase.SHARING)
        return [self._advertisements[site] for site in sorted(self._advertisements)]

    def receive_shares(self, sender: int, shares: Iterable[EncryptedShare]) -> None:
        """Phase 1: hold one site's ciphertexts, which must address exactly its neighbours that advertised."""
        self._advance(Phase.SHARING)
        shares = list(shares)
        if sender not in self._advertisements or sender in self._shared:
            raise ProtocolViolation(f"site {sender} did not advertise, or already sent its shares")
        expected = {n for n in self.setup.neighbours(sender) if n in self._advertisements}
        receivers = [share.receiver for share in shares]
        if any(share.sender != sender for share in shares) or sorted(receivers) != sorted(expected):
            raise ProtocolViolation(f"site {sender}'s shares must go once to each of {sorted(expected)}")
        self._shared.add(sender)
        for share in shares:
            self._shares_to.setdefault(share.receiver, []).append(share)

    def shares_for(self, site: int) -> list[EncryptedShare]:
        """Phase 2 (closes phase 1): the ciphertexts addressed to `site` by sites that sent their shares."""
        self._advance(Phase.MASKING)
        if site not in self._shared:
            raise ProtocolViolation(f"site {site} sent no shares, so it takes no further part")
        return list(self._shares_to.get(site, []))

    def receive_masked_input(self, masked: MaskedInput) -> None:
        """Phase 2: hold one site's masked vector."""
        first = next(iter(self._inputs.values()), None)
        try:
            shape = ring_shape(masked.vector)
        except PrivacyInputError as exc:
            raise ProtocolViolation(f"site {masked.site}'s input: {exc}") from None
        if first is not None and shape != ring_shape(first):
            raise ProtocolViolation(f"site {masked.site}'s input is {shape}, another's {ring_shape(first)}")
        self.note_masked_input(masked.site)
        self._inputs[masked.site] = masked.vector

    def note_masked_input(self, site: int) -> None:
        """Phase 2: record that `site` sent its masked vector, which the caller keeps and sums itself."""
        self._advance(Phase.MASKING)
        if site not in self._shared or site in self._input_sites:
            raise ProtocolViolation(f"site {site} sent no shares, or already sent its input")
        self._input_sites.add(site)

    def unmask_request(self) -> UnmaskRequest:
        """Phase 3 (closes phase 2): survivors sent inputs; dropped sites shared secrets but sent none."""
        if self.phase < Phase.CONSISTENCY:
            self._advance(Phase.CONSISTENCY)
        if self._request is None:
            if len(self._input_sites) < self.setup.min_survivors:
                raise BelowThreshold(f"{len(self._input_sites)} inputs, at least {self.setup.min_survivors} are needed")
            survivors = frozenset(self._input_sites)
            self._request = UnmaskRequest(survivors, frozenset(self._shared - survivors))
        return self._request

    def receive_consistency(self, site: int, signature: bytes) -> None:
        """Phase 3: one survivor's signature of the unmask request and of who advertised what."""
        request = self.unmask_request()
        self._require(Phase.CONSISTENCY, "consistency signature")
        if site not in request.survivors or site in self._signatures:
            raise ProtocolViolation(f"site {site} is not a survivor, or already signed")
        if self.setup.signed:
            assert self.setup.context is not None
            ads = [(a.site, a.num_examples, a.report) for a in self._advertisements.values()]
            message = consistency_message(
                self.setup.context, request.survivors, request.dropped, advertisers_digest(ads)
            )
            if not verify(self.setup.signing_keys[site], message, signature):
                raise ProtocolViolation(f"site {site}'s consistency signature is not of this round's survivor set")
        self._signatures[site] = signature

    def consistency_signatures(self) -> dict[int, bytes]:
        """Phase 4 (closes phase 3): every survivor's consistency signature, relayed to every survivor."""
        if self.setup.signed and len(self._signatures) < self.setup.signature_quorum:  # phase 3 stays open
            raise BelowThreshold(
                f"{len(self._signatures)} consistency signatures, the quorum is {self.setup.signature_quorum}"
            )
        self._advance(Phase.UNMASKING)
        return dict(self._signatures)

    def receive_reveal(self, reveal: ShareReveal) -> None:
        """Phase 4: hold one survivor's revealed shares (from a survivor that signed, in a signed round)."""
        request = self.unmask_request()
        self._advance(Phase.UNMASKING)
        if reveal.site not in request.survivors or reveal.site in self._reveals:
            raise ProtocolViolation(f"site {reveal.site} is not a survivor, or already revealed")
        if self.setup.signed and reveal.site not in self._signatures:
            raise ProtocolViolation(f"site {reveal.site} reveals without having signed the survivor set")
        shares = [*reveal.self_mask_shares.values(), *reveal.mask_key_shares.values()]
        if any(share.x != reveal.site for share in shares):
            raise ProtocolViolation(f"site {reveal.site} revealed shares for another point")
        survivors_ok = reveal.self_mask_shares.keys() <= request.survivors
        if not survivors_ok or not reveal.mask_key_shares.keys() <= request.dropped:
            raise ProtocolViolation(f"site {reveal.site} revealed shares that were not requested")
        self._reveals[reveal.site] = reveal

    @property
    def survivors(self) -> frozenset[int]:
        """The sites whose inputs are in the sum."""
        return self.unmask_request().survivors

    def unmasked_sum(self) -> RingVector:
        """The survivors' ring vectors summed, each section in its ring; BelowThreshold if a secret lacks t shares."""
        return self.unmask(sum_rings(self._inputs.values()))

    def unmask(self, total: RingVector) -> RingVector:
        """Remove every mask from `total`, the ring sum of the survivors' masked vectors, in place; returns it."""
        return apply_masks(total, self.removal_masks())

    def removal_masks(self) -> list[SignedSeed]:
        """The masks unmasking applies to the survivors' sum, each with its sign.

        Minus each survivor's self mask, and the pairwise masks survivors applied with a dropped site, undone.
        """
        request = self.unmask_request()
        masks: list[SignedSeed] = [
            (self._reconstruct(site, "self_mask_shares"), -1) for site in sorted(request.survivors)
        ]
        for dropped in sorted(request.dropped):
            masks.extend(self._dropped_pairwise_masks(dropped, request.survivors))
        return masks

    def _dropped_pairwise_masks(self, dropped: int, survivors: frozenset[int]) -> list[SignedSeed]:
        partners = sorted(share.receiver for share in self._sent_by(dropped) if share.receiver in survivors)
        if not partners:
            return []
        mask_key = private_key_from_bytes(self._reconstruct(dropped, "mask_key_shares"))
        if mask_key.public_key().public_bytes_raw() != self._advertisements[dropped].mask_public:
            raise ProtocolViolation(f"revealed shares do not rebuild site {dropped}'s advertised mask key")
        masks: list[SignedSeed] = []
        for partner in partners:
            seed = mask_seed(
                mask_key,
                self._advertisements[partner].mask_public,
                study_uid=self.setup.study_uid,
                round_no=self.setup.round_no,
                sites=(dropped, partner),
            )
            masks.append((seed, -pairwise_sign(partner, dropped)))  # undo what the partner applied
        return masks

    def _reconstruct(self, owner: int, kind: str) -> bytes:
        shares: list[Share] = [
            getattr(reveal, kind)[owner] for reveal in self._reveals.values() if owner in getattr(reveal, kind)
        ]
        try:
            return reconstruct_secret(shares, threshold=self.setup.threshold)
        except NotEnoughShares as exc:
            secret = "self-mask seed" if kind == "self_mask_shares" else "mask key"
            raise NotEnoughShares(f"site {owner}'s {secret}: {exc}") from exc

    def _sent_by(self, sender: int) -> list[EncryptedShare]:
        return [share for shares in self._shares_to.values() for share in shares if share.sender == sender]

    def _require(self, phase: Phase, what: str) -> None:
        if self.phase != phase:
            raise ProtocolViolation(f"{what} arrived in phase {self.phase.name}, expected {phase.name}")

    def _advance(self, phase: Phase) -> None:
        if self.phase > phase:
            raise ProtocolViolation(f"phase {phase.name} is over (now {self.phase.name})")
        self.phase = phase

    def _require_site(self, site: int) -> None:
        if site not in self.setup.sites:
            raise ProtocolViolation(f"site {site} is not in {self.setup.label}")
