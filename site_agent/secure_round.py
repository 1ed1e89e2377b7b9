"""A site's side of a secure round (SecAgg+): advertise, share, mask and upload, sign, reveal; one step per poll.

The round's setup (numbering, neighbour graph, threshold, signature quorum, fewest survivors,
fraction bits, every site's signing key) is the site's own, derived from the terms its operator
approved and the round's participants (shared/study/round_terms.py `secure_setup`); the task's copy was checked to agree
before training (site_agent/task_check.py), and a round view of another round attempt is declined.

The coordinator is not trusted. After training (or the final evaluation) the site advertises its
round keys with n_k, its scalar metrics and theta^g's digest, signed with its long-term key (the
signature covers n_k and what the weighting reads of the metrics, all that the other sites see);
later polls read the round (`GET SecureRoundInfo.url?wait=`, a long-poll that answers as soon as the
site has a move or the phase changes) and send what its phase asks for. It shares nothing unless
every advertisement is signed by its site and names its own theta^g; it computes its own weight
w_k from those signed advertisements (the coordinator names none); it signs the survivor set it is
told and reveals only when a quorum of survivors signed the same (shared/privacy/client.py); and it
records, before its shares leave, that it revealed for this round, so it takes part in no other
attempt of it (a retry would let the coordinator difference two sums); its ledger
(site_agent/ledger.py) also keeps every theta^g it took part in a secure round from.
The masked vector (shared.study.secagg.site_vector: w_k (theta_k - theta^g) in Z_{2^32},
where the terms' ring_bits is 32, else w_k theta_k; Scaffold's Delta c_k with weight 1, w_k itself,
the pooled statistics in Z_{2^64}; then masked) goes up as an ordinary update of its two sections
(`secagg.masked32`, `secagg.masked`), through the worker's pending-update path: it and the
pending phi_k are written to the encrypted store first, and phi_k is committed once the
coordinator accepted it.

Crash semantics: the round's secrets (ClientState: private keys, self-mask seed, shares held)
live in memory only. An agent that stops mid-round is a dropped site for that round, which the
protocol tolerates; the coordinator does not offer it the round again (no second advertisement),
a pending masked upload is re-sent as is, and the agent takes the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from shared.privacy.client import ClientState
from shared.privacy.errors import PrivacyError, ProtocolViolation
from shared.privacy.messages import EncryptedShare, KeyAdvertisement, UnmaskRequest
from shared.privacy.signing import SiteIdentity
from shared.study.round_terms import secure_setup
from shared.study.rules import masked_update_schema, secure_layout, secure_site_vector
from shared.study.secure_setup import site_numbers
from shared.study.server_round import SiteReport, round_weights, weights_read
from shared.tensors.codec import TensorDict, dump_into
from shared.wire.protocol import RoundKind, TaskSpec, UpdateMeta
from shared.wire.secure import (
    MASKED_NARROW,
    MASKED_TENSOR,
    Advertisement,
    Consistency,
    Reveal,
    SealedShare,
    SecureRoundView,
    ShareBatch,
    b64,
    from_b64,
)
from shared.wire.urls import secure_url
from site_agent.client import CoordinatorClient
from site_agent.errors import TaskMismatch
from site_agent.local_round import LocalRoundResult, LocalRoundSpec
from site_agent.task_check import check_round_view

__all__ = ["SecureRound"]

log = logging.getLogger(__name__)


class SecureRound:
    """One secure round in progress at this site: its secrets, its trained result, and what it has sent."""

    def __init__(
        self,
        task: TaskSpec,
        spec: LocalRoundSpec,
        study: str,
        result: LocalRoundResult,
        identity: SiteIdentity | None,
        revealed: Callable[[int, int], None] = lambda _round, _attempt: None,
        base: TensorDict | None = None,
    ) -> None:
        secure = spec.privacy.secure_aggregation
        assert secure is not None
        self.task, self.spec, self.study, self.result = task, spec, study, result
        self.url = secure_url(task.round_id)
        setup = secure_setup(
            spec.terms,
            study_uid=task.study_uid,
            number=task.round,
            attempt=task.attempt,
            participants=task.participants,
            global_digest=task.global_model_sha256,
        )
        self.numbers = site_numbers(task.participants)
        self.site = self.numbers[spec.site]
        self.secrets = ClientState(setup, self.site, identity=identity)
        self.layout = secure_layout(
            spec.model,
            spec.algorithm,
            train=task.kind is RoundKind.TRAIN,
            fraction_bits=secure.fraction_bits,
            ring_bits=secure.ring_bits,
        )
        self.clear_meta = UpdateMeta(  # what leaves in the clear: scalars only, statistics go under the masks
            num_examples=result.meta.num_examples,
            metrics=result.meta.metrics.model_copy(update={"eval_stats": None}),
            train_seconds=result.meta.train_seconds,
        )
        self.revealed = revealed  # records, in the site's store, that this round's shares went out
        self.base = base  # theta^g of the round, which the Z_{2^32} section's changes are taken from
        self.weight: float | None = None  # w_k, computed from the advertisements it verified (phase 1)
        self.finished = False

    def advertise(self, client: CoordinatorClient) -> None:
        """Phase 0: the round's public keys with n_k, the scalars the weighting reads and theta^g's digest, signed."""
        metrics = self.clear_meta.metrics.model_dump(mode="json")
        ad = self.secrets.advertise(self.clear_meta.num_examples, weights_read(self.spec.terms, metrics))
        message = Advertisement(
            cipher_public=b64(ad.cipher_public),
            mask_public=b64(ad.mask_public),
            num_examples=self.clear_meta.num_examples,
            metrics=self.clear_meta.metrics,
            train_seconds=self.clear_meta.train_seconds,
            global_sha256=self.task.global_model_sha256,
            signature=ad.signature.hex(),
        )
        client.post_secure(f"{self.url}/advertisement", message)

    def step(self, client: CoordinatorClient, send_update: Callable[[bytearray], None]) -> bool:
        """Do what the round's phase asks of this site now; True when something was sent or the round ended."""
        view = client.secure_round(self.url, wait=True)  # answers at once when this site has a move
        check_round_view(view, self.task.round_id)
        if view.status != "open":
            log.info("secure round %d: %s", self.task.round_id, view.status)
            self.finished = True
            return True
        try:
            if self._move(client, view, send_update):
                return True
        except ProtocolViolation as exc:  # the coordinator relayed what the round's setup does not allow
            self.finished = True
            raise TaskMismatch(f"the secure round's view breaks its setup: {exc}") from None
        except PrivacyError as exc:  # too few neighbours left, or a request that could unmask this site
            log.warning("secure round %d: leaving the round: %s", self.task.round_id, exc)
            self.finished = True
            return True
        if view.phase is not None and view.phase >= 1 and 0 not in view.sent:
            self.finished = True  # the advertisement came too late: this site takes no part in the round
        return False

    def _move(self, client: CoordinatorClient, view: SecureRoundView, send: Callable[[bytearray], None]) -> bool:
        """Send the site's message of the view's phase, if it owes one now; True when it sent something."""
        owes = view.phase is not None and view.phase not in view.sent and view.phase - 1 in view.sent
        if not owes:
            return False
        request = UnmaskRequest(frozenset(view.survivors or []), frozenset(view.dropped or []))
        if view.phase == 1:
            self._share(client, view)
        elif view.phase == 2 and self.weight is not None:
            send(self._masked_update(self.weight, view.shares))
        elif view.phase == 3 and self.site in request.survivors:
            signature = self.secrets.sign_consistency(request)
            client.post_secure(f"{self.url}/consistency", Consistency(signature=signature.hex()))
        elif view.phase == 4:
            signatures = {int(site): bytes.fromhex(text) for site, text in view.signatures.items()}
            reveal = self.secrets.reveal_shares(request, signatures)
            self.revealed(self.task.round, self.task.attempt)  # before the shares leave: no other attempt of it
            message = Reveal(
                self_mask_shares={o: format(s.y, "x") for o, s in reveal.self_mask_shares.items()},
                mask_key_shares={o: format(s.y, "x") for o, s in reveal.mask_key_shares.items()},
            )
            client.post_secure(f"{self.url}/reveal", message)
        else:
            return False
        return True

    def _share(self, client: CoordinatorClient, view: SecureRoundView) -> None:
        """Phase 1: check every advertisement, compute this site's weight from them, share the secrets."""
        ads = [
            KeyAdvertisement(
                p.site,
                from_b64(p.cipher_public),
                from_b64(p.mask_public),
                p.num_examples,
                p.report,
                p.global_sha256,
                bytes.fromhex(p.signature),
            )
            for p in view.peers
        ]
        shares = self.secrets.share_secrets(ads)  # checks every signature and theta^g digest first
        self.weight = self._own_weight(ads)
        batch = [SealedShare(receiver=s.receiver, ciphertext=b64(s.ciphertext)) for s in shares]
        client.post_secure(f"{self.url}/shares", ShareBatch(shares=batch))

    def _own_weight(self, ads: list[KeyAdvertisement]) -> float:
        """w_k as the study's weighting gives it over every advertiser: the site's own, not one the hub names."""
        names = {number: name for name, number in self.numbers.items()}
        reports = [SiteReport(names[ad.site], ad.num_examples, dict(ad.report)) for ad in sorted(ads, key=_site)]
        weights = round_weights(self.spec.terms, reports)
        return weights[[report.site for report in reports].index(self.spec.site)]

    def _masked_update(self, weight: float, relayed: list[Any]) -> bytearray:
        """The upload's body, built in place: the ring vector is written and masked inside it, never copied."""
        body, views = dump_into(masked_update_schema(self.layout), self.clear_meta.to_metadata())  # encode_update's
        narrow = views[MASKED_NARROW].numpy().view(np.uint32) if MASKED_NARROW in views else np.empty(0, np.uint32)
        ring = (narrow, views[MASKED_TENSOR].numpy().view(np.uint64))
        spec, result = self.spec, self.result
        secure_site_vector(
            self.layout,
            spec.model,
            spec.algorithm,
            spec.site,
            result.shared,
            weight,
            result.meta,
            ring,
            self.base,
            result.grid,
        )
        received = [EncryptedShare(s.sender, self.site, from_b64(s.ciphertext)) for s in relayed]
        self.secrets.mask_input(ring, received, in_place=True)
        return body


def _site(ad: KeyAdvertisement) -> int:
    return ad.site
