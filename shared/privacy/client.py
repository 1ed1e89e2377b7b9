"""A site's side of one SecAgg+ round: advertise keys, share secrets, mask the input, sign the survivors, reveal.

The calls follow the phases of Bonawitz et al. (CCS 2017, Fig. 4) restricted to the site's
neighbours (Bell et al., CCS 2020). The site refuses any request that could unmask its input:
revealing shares for fewer than `min_survivors` sites, for a site both as survivor and as dropped,
or a second, different set of shares. In a signed round (RoundSetup.signing_keys: a malicious
server) it also refuses advertisements that are not signed by their site's long-term key or that
name another theta^g than its own, and reveals only when the setup's signature quorum q of
survivors (q = floor((K + c) / 2) + 1, its own signature included: shared/privacy/graph.py) signed
the very survivor set and advertiser set it signed itself, and no one signed another: only one
story can gather q signatures, so a server that equivocates learns nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import replace

from shared.privacy.errors import BelowThreshold, ProtocolViolation
from shared.privacy.keys import (
    RoundKeys,
    decrypt_share_payload,
    encrypt_share_payload,
    mask_seed,
    share_encryption_key,
)
from shared.privacy.masking import RingVector, mask_vector
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
from shared.privacy.signing import SiteIdentity, advertisers_digest, consistency_message, verify

__all__ = ["ClientState"]


class ClientState:
    """One site's keys, secrets and received shares for one round; each method is one phase."""

    def __init__(
        self, setup: RoundSetup, site: int, *, keys: RoundKeys | None = None, identity: SiteIdentity | None = None
    ) -> None:
        if site not in setup.sites:
            raise ProtocolViolation(f"site {site} is not in {setup.label}")
        if setup.signed and (identity is None or identity.public_bytes() != setup.signing_keys[site]):
            raise ProtocolViolation(f"site {site}'s signing key is not the one the round names")
        self.setup, self.site, self.identity = setup, site, identity
        self.keys = keys if keys is not None else RoundKeys.generate()
        self._self_mask_seed = secrets.token_bytes(SEED_BYTES)
        self._peers: dict[int, KeyAdvertisement] = {}
        self._held: dict[int, SharedSecrets] = {}  # owner -> this site's shares of the owner's secrets
        self._advertisers = ""  # signing.advertisers_digest of the advertisements it verified
        self._signed: UnmaskRequest | None = None  # the request it signed in the consistency phase
        self._reveal: tuple[UnmaskRequest, ShareReveal] | None = None
        self.advertisement: KeyAdvertisement | None = None

    def advertise(self, num_examples: int = 0, report: Mapping[str, object] | None = None) -> KeyAdvertisement:
        """Phase 0: the public keys to relay, with what the weighting reads; signed in a signed round."""
        context = self.setup.context
        ad = KeyAdvertisement(
            self.site,
            self.keys.cipher_public(),
            self.keys.mask_public(),
            num_examples,
            dict(report or {}),
            context.global_digest if context is not None else "",
        )
        if self.setup.signed:
            assert self.identity is not None and context is not None
            ad = replace(ad, signature=self.identity.sign(ad.message(context)))
        self.advertisement = ad
        return ad

    def share_secrets(self, advertisements: Iterable[KeyAdvertisement]) -> list[EncryptedShare]:
        """Phase 1: check every advertisement, then Shamir-share the self-mask seed and the mask key among neighbours.

        `advertisements` are every site's that advertised (the weights read them all); only the
        neighbours' keys are used here. In a signed round each must bear its site's signature and
        name this site's theta^g, and this site's own must be among them as it sent it.
        """
        if self._peers:
            raise ProtocolViolation(f"site {self.site} already shared its secrets this round")
        verified = self.verified_advertisements(advertisements)
        neighbours = self.setup.neighbours(self.site)
        peers = {site: ad for site, ad in verified.items() if site in neighbours}
        if len(peers) < self.setup.threshold:
            raise BelowThreshold(f"{len(peers)} neighbours advertised, the threshold is {self.setup.threshold}")
        points = sorted(peers)
        threshold = self.setup.threshold
        self_mask_shares = split_secret(self._self_mask_seed, threshold=threshold, points=points)
        mask_key_shares = split_secret(self.keys.mask_private_bytes(), threshold=threshold, points=points)
        self._peers = peers
        self._advertisers = advertisers_digest([(a.site, a.num_examples, a.report) for a in verified.values()])
        return [
            self._seal(SharedSecrets(self.site, b.x, b.y, s.y))
            for b, s in zip(self_mask_shares, mask_key_shares, strict=True)
        ]

    def verified_advertisements(self, advertisements: Iterable[KeyAdvertisement]) -> dict[int, KeyAdvertisement]:
        """The advertisements by site, each checked (signature, theta^g, one per site); ProtocolViolation if not."""
        verified: dict[int, KeyAdvertisement] = {}
        context = self.setup.context
        for ad in advertisements:
            if ad.site not in self.setup.sites or ad.site in verified:
                raise ProtocolViolation(f"an advertisement of site {ad.site} is not in {self.setup.label}")
            if self.setup.signed:
                assert context is not None
                if not verify(self.setup.signing_keys[ad.site], ad.message(context), ad.signature):
                    raise ProtocolViolation(f"site {ad.site}'s advertisement is not signed by its signing key")
                if ad.global_digest != context.global_digest:
                    raise ProtocolViolation(
                        f"site {ad.site} trained from theta^g {ad.global_digest[:12]}, this site from "
                        f"{context.global_digest[:12]}: the server gave sites different models"
                    )
            verified[ad.site] = ad
        if self.advertisement is not None and verified.get(self.site) != self.advertisement:
            raise ProtocolViolation(f"site {self.site}'s own advertisement is missing or altered")
        return verified

    def mask_input(
        self, ring_vector: RingVector, received: Iterable[EncryptedShare], *, in_place: bool = False
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

    def sign_consistency(self, request: UnmaskRequest) -> bytes:
        """Phase 3: this survivor's signature of the one unmask request (and advertiser set) it was told.

        It signs once: a second, different request is an equivocating server.
        """
        self._check_request(request)
        if self._signed is not None and self._signed != request:
            raise ProtocolViolation(f"site {self.site} was told two different survivor sets")
        self._signed = request
        if not self.setup.signed:
            return b""
        assert self.identity is not None and self.setup.context is not None
        return self.identity.sign(self._consistency_message(request))

    def reveal_shares(self, request: UnmaskRequest, signatures: Mapping[int, bytes] | None = None) -> ShareReveal:
        """Phase 4: self-mask shares of survivors and mask-key shares of dropped partners, never both for one site.

        In a signed round: only for the request this site signed, when at least the signature quorum of
        survivors' valid signatures agree on it, and none disagrees; else ProtocolViolation, and nothing
        is revealed.
        """
        if self._reveal is not None:
            if self._reveal[0] != request:
                raise ProtocolViolation(f"site {self.site} already revealed shares for a different request")
            return self._reveal[1]
        self._check_request(request)
        if self.setup.signed:
            self._check_signatures(request, signatures or {})
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

    def _check_request(self, request: UnmaskRequest) -> None:
        if not self._held:
            raise ProtocolViolation(f"site {self.site} has not masked an input this round")
        if request.survivors & request.dropped:
            raise ProtocolViolation(f"sites {sorted(request.survivors & request.dropped)} both survived and dropped")
        if self.site not in request.survivors:
            raise ProtocolViolation(f"site {self.site} sent its input but is not listed as a survivor")
        if not request.survivors <= set(self.setup.sites) or not request.dropped <= set(self.setup.sites):
            raise ProtocolViolation("the request names sites outside the round")
        if len(request.survivors) < self.setup.min_survivors:
            raise BelowThreshold(f"{len(request.survivors)} survivors, at least {self.setup.min_survivors} are needed")

    def _consistency_message(self, request: UnmaskRequest) -> bytes:
        assert self.setup.context is not None
        return consistency_message(self.setup.context, request.survivors, request.dropped, self._advertisers)

    def _check_signatures(self, request: UnmaskRequest, signatures: Mapping[int, bytes]) -> None:
        """At least the quorum of survivors' valid signatures of this site's own request, and no other signature."""
        if self._signed != request:
            raise ProtocolViolation(f"site {self.site} signed another survivor set than the one it is asked to reveal")
        message = self._consistency_message(request)
        for signer, signature in signatures.items():
            if signer not in request.survivors:
                raise ProtocolViolation(f"a consistency signature of site {signer}, which is no survivor")
            if not verify(self.setup.signing_keys[signer], message, signature):
                raise ProtocolViolation(
                    f"site {signer}'s consistency signature is not of the survivor set this site signed: "
                    "the server told sites different stories"
                )
        if len(signatures) < self.setup.signature_quorum:
            raise ProtocolViolation(
                f"{len(signatures)} survivors signed the survivor set, the quorum is {self.setup.signature_quorum}"
            )

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
