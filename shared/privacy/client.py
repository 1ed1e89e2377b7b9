"""A site's side of one SecAgg+ round: advertise keys, share secrets, mask the input, reveal shares.

The calls follow the phases of Bonawitz et al. (CCS 2017, Fig. 4) restricted to the site's
neighbours (Bell et al., CCS 2020). The site refuses any request that could unmask its input:
revealing shares for fewer than `min_survivors` sites, for a site both as survivor and as dropped,
or a second, different set of shares.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import numpy as np

from shared.privacy.errors import BelowThreshold, ProtocolViolation
from shared.privacy.keys import (
    RoundKeys,
    decrypt_share_payload,
    encrypt_share_payload,
    mask_seed,
    share_encryption_key,
)
from shared.privacy.masking import mask_vector
from shared.privacy.messages import (
    EncryptedShare,
    KeyAdvertisement,
    MaskedInput,
    RoundSetup,
    SharedSecrets,
    ShareReveal,
    UnmaskRequest,
)
from shared.privacy.prg import SEED_BYTES
from shared.privacy.shamir import Share, split_secret

__all__ = ["ClientState"]


class ClientState:
    """One site's keys, secrets and received shares for one round; each method is one phase."""

    def __init__(self, setup: RoundSetup, site: int, *, keys: RoundKeys | None = None) -> None:
        if site not in setup.sites:
            raise ProtocolViolation(f"site {site} is not in round {setup.round_no}")
        self.setup, self.site = setup, site
        self.keys = keys if keys is not None else RoundKeys.generate()
        self._self_mask_seed = secrets.token_bytes(SEED_BYTES)
        self._peers: dict[int, KeyAdvertisement] = {}
        self._held: dict[int, SharedSecrets] = {}  # owner -> this site's shares of the owner's secrets
        self._reveal: tuple[UnmaskRequest, ShareReveal] | None = None

    def advertise(self) -> KeyAdvertisement:
        """Phase 0: the public keys to relay to this site's neighbours."""
        return KeyAdvertisement(self.site, self.keys.cipher_public(), self.keys.mask_public())

    def share_secrets(self, advertisements: Iterable[KeyAdvertisement]) -> list[EncryptedShare]:
        """Phase 1: Shamir-share the self-mask seed and the mask key among the neighbours that advertised."""
        if self._peers:
            raise ProtocolViolation(f"site {self.site} already shared its secrets this round")
        neighbours = self.setup.neighbours(self.site)
        peers = {ad.site: ad for ad in advertisements if ad.site != self.site}
        if not peers.keys() <= neighbours:
            raise ProtocolViolation(f"advertisements from non-neighbours {sorted(peers.keys() - neighbours)}")
        if len(peers) < self.setup.threshold:
            raise BelowThreshold(f"{len(peers)} neighbours advertised, the threshold is {self.setup.threshold}")
        points = sorted(peers)
        threshold = self.setup.threshold
        self_mask_shares = split_secret(self._self_mask_seed, threshold=threshold, points=points)
        mask_key_shares = split_secret(self.keys.mask_private_bytes(), threshold=threshold, points=points)
        self._peers = peers
        return [
            self._seal(SharedSecrets(self.site, b.x, b.y, s.y))
            for b, s in zip(self_mask_shares, mask_key_shares, strict=True)
        ]

    def mask_input(
        self, ring_vector: np.ndarray, received: Iterable[EncryptedShare], *, in_place: bool = False
    ) -> MaskedInput:
        """Phase 2: open the shares neighbours sent, then mask `ring_vector` (a copy, or it in place) with them."""
        if not self._peers:
            raise ProtocolViolation(f"site {self.site} must share its secrets before masking")
        if self._held:
            raise ProtocolViolation(f"site {self.site} already masked its input this round")
        held = {}
        for share in received:
            opened = self._open(share)
            held[opened.owner] = opened
        if len(held) < self.setup.threshold:
            raise BelowThreshold(f"{len(held)} neighbours sent shares, the threshold is {self.setup.threshold}")
        self._held = held
        seeds = {peer: self._pairwise_seed(peer) for peer in held}
        vector = mask_vector(
            ring_vector, site=self.site, self_mask_seed=self._self_mask_seed, pairwise_seeds=seeds, in_place=in_place
        )
        return MaskedInput(self.site, vector)

    def reveal_shares(self, request: UnmaskRequest) -> ShareReveal:
        """Phase 3: self-mask shares of survivors and mask-key shares of dropped partners, never both for one site."""
        if not self._held:
            raise ProtocolViolation(f"site {self.site} has not masked an input this round")
        if self._reveal is not None:
            if self._reveal[0] != request:
                raise ProtocolViolation(f"site {self.site} already revealed shares for a different request")
            return self._reveal[1]
        if request.survivors & request.dropped:
            raise ProtocolViolation(f"sites {sorted(request.survivors & request.dropped)} both survived and dropped")
        if self.site not in request.survivors:
            raise ProtocolViolation(f"site {self.site} sent its input but is not listed as a survivor")
        if not request.survivors <= set(self.setup.sites) or not request.dropped <= set(self.setup.sites):
            raise ProtocolViolation("the request names sites outside the round")
        if len(request.survivors) < self.setup.min_survivors:
            raise BelowThreshold(f"{len(request.survivors)} survivors, at least {self.setup.min_survivors} are needed")
        reveal = ShareReveal(
            self.site,
            self_mask_shares={
                owner: Share(self.site, held.self_mask_share)
                for owner, held in self._held.items()
                if owner in request.survivors
            },
            mask_key_shares={
                owner: Share(self.site, held.mask_key_share)
                for owner, held in self._held.items()
                if owner in request.dropped
            },
        )
        self._reveal = (request, reveal)
        return reveal

    def _seal(self, secrets_for_holder: SharedSecrets) -> EncryptedShare:
        holder = secrets_for_holder.holder
        ciphertext = encrypt_share_payload(
            self._share_key(holder),
            secrets_for_holder.to_bytes(),
            study_uid=self.setup.study_uid,
            round_no=self.setup.round_no,
            sender=self.site,
            receiver=holder,
        )
        return EncryptedShare(self.site, holder, ciphertext)

    def _open(self, share: EncryptedShare) -> SharedSecrets:
        if share.receiver != self.site or share.sender not in self._peers:
            raise ProtocolViolation(f"share from {share.sender} to {share.receiver} is not for site {self.site}")
        plaintext = decrypt_share_payload(
            self._share_key(share.sender),
            share.ciphertext,
            study_uid=self.setup.study_uid,
            round_no=self.setup.round_no,
            sender=share.sender,
            receiver=self.site,
        )
        opened = SharedSecrets.from_bytes(plaintext)
        if (opened.owner, opened.holder) != (share.sender, self.site):
            raise ProtocolViolation(f"share from {share.sender} names owner {opened.owner}, holder {opened.holder}")
        return opened

    def _share_key(self, peer: int) -> bytes:
        return share_encryption_key(
            self.keys.cipher,
            self._peers[peer].cipher_public,
            study_uid=self.setup.study_uid,
            round_no=self.setup.round_no,
            sites=(self.site, peer),
        )

    def _pairwise_seed(self, peer: int) -> bytes:
        return mask_seed(
            self.keys.mask,
            self._peers[peer].mask_public,
            study_uid=self.setup.study_uid,
            round_no=self.setup.round_no,
            sites=(self.site, peer),
        )
