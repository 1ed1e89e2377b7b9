"""A secure round's messages (SecAgg+): what each site sends in each phase, checked and stored; what it may see.

The phases (coordinator/rounds/secure.py): 0 advertise (two X25519 public keys, n_k, scalar
metrics, theta^g's digest; n_k, what the weighting reads of the metrics and the rest signed by the
site's long-term key), 1 share (sealed Shamir shares
for each neighbour), 2 mask (the masked vector, an ordinary update: coordinator/rounds/updates.py),
3 consistency (each survivor's signature of the survivor set), 4 reveal (the shares the unmasking
needs). Each message is checked by replaying the earlier phases through a ServerState
(shared/privacy/server.py) and stored in `secagg_messages`; a site reads the round (`look`) as its
phase and what is relayed to it: every advertisement, with n_k and only what the weighting reads of
its metrics (it computes every weight from them; it sees no other metric of a peer), the
shares addressed to it, the survivor set, and then every survivor's consistency signature.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.errors import (
    Forbidden,
    InvalidSecAggMessage,
    InvalidUpload,
    NotAParticipant,
    RoundClosed,
    WrongPhase,
)
from coordinator.models import Round, RoundStatus, SecAggMessage, Site, Study, Update
from coordinator.sites.security import Principal
from shared.privacy.errors import PrivacyError
from shared.privacy.messages import EncryptedShare, KeyAdvertisement, RoundSetup, ShareReveal
from shared.privacy.server import ServerState
from shared.privacy.shamir import Share
from shared.study.round_terms import secure_setup
from shared.study.server_round import SiteReport, round_weights, weights_read
from shared.terms import StudyTerms
from shared.wire.secure import PeerAdvertisement, RelayedShare, SecureRoundView, from_b64

__all__ = [
    "ADVERTISE",
    "CONSISTENCY",
    "MASK",
    "PHASES",
    "PHASE_NAMES",
    "REVEAL",
    "SHARE",
    "check_advertised",
    "check_masked_upload",
    "look",
    "receive",
    "replay",
    "senders",
    "setup_of",
    "view",
]

ADVERTISE, SHARE, MASK, CONSISTENCY, REVEAL = 0, 1, 2, 3, 4
PHASES = (ADVERTISE, SHARE, MASK, CONSISTENCY, REVEAL)
PHASE_NAMES = ("advertise", "share", "mask", "consistency", "reveal")


def setup_of(round_: Round, terms: StudyTerms) -> RoundSetup:
    """The round's public setup, signing keys and context included, as every site derives it from the terms."""
    state = round_.secagg_state or {}
    return secure_setup(
        terms,
        study_uid=state["study_uid"],
        number=round_.number,
        attempt=round_.attempt,
        participants=list(round_.participants),
        global_digest=round_.base_sha256,
    )


def _locked_round(session: Session, round_id: int) -> Round:
    round_ = session.scalar(select(Round).where(Round.id == round_id).with_for_update())
    if round_ is None:  # the route's Participant dependency refused it first; to a site it is a 403 alike
        raise NotAParticipant(f"this site was not selected for round {round_id}")
    if round_.secagg_phase is None:
        raise WrongPhase(f"round {round_id} is not a secure round", code="not_a_secure_round")
    return round_


def senders(session: Session, round_id: int, phase: int) -> dict[str, dict[str, Any]]:
    """Site name -> message body of every message of `phase` (phase 2: the masked updates' sha256)."""
    if phase == MASK:
        updates = session.execute(
            select(Site.name, Update.sha256).join(Site, Update.site_id == Site.id).where(Update.round_id == round_id)
        ).all()
        return {name: {"sha256": digest} for name, digest in updates}
    rows = session.execute(
        select(Site.name, SecAggMessage.body)
        .join(Site, SecAggMessage.site_id == Site.id)
        .where(SecAggMessage.round_id == round_id, SecAggMessage.phase == phase)
    ).all()
    return dict(rows)


def receive(
    session: Session,
    *,
    round_id: int,
    site: Principal,
    phase: int,
    message: BaseModel,
    max_num_examples: int,
    now: datetime,
) -> bool:
    """Store one site's message of `phase`; False when the same message was stored before (idempotent)."""
    assert site.site_id is not None and site.site_name is not None
    round_ = _locked_round(session, round_id)
    assert round_.secagg_phase is not None  # _locked_round refused a round that is not secure
    if site.site_name not in round_.participants:
        raise NotAParticipant.of_round(site.site_name, round_id)
    study = session.get(Study, round_.study_id)
    assert study is not None  # the round's study: a foreign key
    terms = study.terms
    body = message.model_dump(mode="json")
    if phase == ADVERTISE:  # kept beside it: what its signature covers, and all that the other sites are relayed
        body["report"] = weights_read(terms, body["metrics"])
    existing = session.scalar(
        select(SecAggMessage.body).where(
            SecAggMessage.round_id == round_id, SecAggMessage.site_id == site.site_id, SecAggMessage.phase == phase
        )
    )
    if existing is not None:
        if existing != body:
            raise WrongPhase(
                f"site {site.site_name!r} already sent another {PHASE_NAMES[phase]} message", code="duplicate_message"
            )
        session.rollback()
        return False
    if round_.status != RoundStatus.OPEN:
        raise RoundClosed(f"round {round_id} is {round_.status}")
    if round_.secagg_phase != phase:
        raise WrongPhase(
            f"round {round_id} is in phase {round_.secagg_phase} ({PHASE_NAMES[round_.secagg_phase]}); "
            f"a {PHASE_NAMES[phase]} message (phase {phase}) is refused"
        )
    _check(session, round_, terms, site.site_name, phase, body, max_num_examples)
    session.add(SecAggMessage(round_id=round_id, site_id=site.site_id, phase=phase, body=body, created_at=now))
    audit.record(
        session,
        "secagg.message",
        actor=site.actor,
        study_id=round_.study_id,
        round_id=round_id,
        site_id=site.site_id,
        phase=phase,
    )
    session.commit()
    return True


def check_masked_upload(session: Session, round_: Round, site_name: str) -> None:
    """WrongPhase outside phase 2; Forbidden (not_in_phase) for a site that did not share its secrets."""
    if round_.secagg_phase != MASK:
        raise WrongPhase(
            f"round {round_.id} is in phase {round_.secagg_phase} ({PHASE_NAMES[round_.secagg_phase or 0]}); "
            "masked vectors are taken in phase 2 (mask)"
        )
    if site_name not in senders(session, round_.id, SHARE):
        raise Forbidden(
            f"site {site_name!r} sent no shares in phase 1, so it takes no further part in round {round_.id}",
            code="not_in_phase",
        )


def check_advertised(session: Session, round_id: int, site_name: str, num_examples: int) -> None:
    """InvalidUpload unless the masked update's n_k is the one the site advertised in phase 0."""
    advertised = senders(session, round_id, ADVERTISE).get(site_name, {}).get("num_examples")
    session.rollback()
    if advertised != num_examples:
        raise InvalidUpload(
            f"n_k = {num_examples} differs from the {advertised} advertised in phase 0", code="invalid_update_meta"
        )


def _check(
    session: Session, round_: Round, terms: StudyTerms, name: str, phase: int, body: dict[str, Any], max_n: int
) -> None:
    """InvalidSecAggMessage when the message breaks the protocol, replayed through a ServerState.

    The ServerState checks, as every site does, each advertisement's signature and theta^g digest
    and each consistency signature, so this coordinator refuses what the sites would refuse.
    """
    number = (round_.secagg_state or {})["sites"][name]
    try:
        if phase == ADVERTISE:
            if body["num_examples"] > max_n:
                raise ValueError(f"n_k = {body['num_examples']} exceeds the plausible maximum {max_n}")
            # what the weighting reads (uncertainty: H_k) must be there now
            round_weights(terms, [SiteReport(name, body["num_examples"], body["metrics"])])
        # Only the phases before this one: the sender's own earlier message of it is refused upstream
        # (duplicate_message), so the other sites' messages of this phase need not be replayed.
        server = replay(session, round_, terms, through=phase - 1)
        if phase == ADVERTISE:
            server.receive_advertisement(_advertisement(number, body))
        elif phase == SHARE:
            server.receive_shares(number, _sealed(number, body))
        elif phase == CONSISTENCY:
            server.receive_consistency(number, bytes.fromhex(body["signature"]))
        elif phase == REVEAL:
            server.consistency_signatures()
            server.receive_reveal(_reveal(number, body))
    except (PrivacyError, ValueError) as exc:
        raise InvalidSecAggMessage(f"{PHASE_NAMES[phase]} message refused: {exc}") from None


def _advertisement(number: int, body: dict[str, Any]) -> KeyAdvertisement:
    """A stored advertisement as every site checks it: its signature covers n_k and what the weighting reads."""
    return KeyAdvertisement(
        number,
        from_b64(body["cipher_public"]),
        from_b64(body["mask_public"]),
        body["num_examples"],
        body["report"],
        body["global_sha256"],
        bytes.fromhex(body["signature"]),
    )


def _sealed(number: int, body: dict[str, Any]) -> list[EncryptedShare]:
    return [EncryptedShare(number, share["receiver"], from_b64(share["ciphertext"])) for share in body["shares"]]


def _reveal(number: int, body: dict[str, Any]) -> ShareReveal:
    return ShareReveal(
        number,
        self_mask_shares={int(o): Share(number, int(y, 16)) for o, y in body["self_mask_shares"].items()},
        mask_key_shares={int(o): Share(number, int(y, 16)) for o, y in body["mask_key_shares"].items()},
    )


def replay(session: Session, round_: Round, terms: StudyTerms, through: int = REVEAL) -> ServerState:
    """A ServerState of the messages stored so far, up to the round's phase and `through` (inputs: who sent one)."""
    numbers: dict[str, int] = (round_.secagg_state or {})["sites"]
    last = min(round_.secagg_phase if round_.secagg_phase is not None else ADVERTISE, through)
    server = ServerState(setup_of(round_, terms))
    if last < ADVERTISE:
        return server
    for name, body in sorted(senders(session, round_.id, ADVERTISE).items()):
        server.receive_advertisement(_advertisement(numbers[name], body))
    if last < SHARE:
        return server
    server.advertisements()
    for name, body in sorted(senders(session, round_.id, SHARE).items()):
        server.receive_shares(numbers[name], _sealed(numbers[name], body))
    if last < MASK:
        return server
    for name in sorted(senders(session, round_.id, MASK)):
        server.note_masked_input(numbers[name])
    if last < CONSISTENCY:
        return server
    server.unmask_request()
    for name, body in sorted(senders(session, round_.id, CONSISTENCY).items()):
        server.receive_consistency(numbers[name], bytes.fromhex(body["signature"]))
    if last < REVEAL:
        return server
    server.consistency_signatures()
    for name, body in sorted(senders(session, round_.id, REVEAL).items()):
        server.receive_reveal(_reveal(numbers[name], body))
    return server


def view(session: Session, round_id: int, site: Principal) -> SecureRoundView:
    """What `site` may see of the round now: its phase and what is relayed to it."""
    return look(session, round_id, site)[0]


def look(session: Session, round_id: int, site: Principal) -> tuple[SecureRoundView, bool]:
    """The site's view of the round, and whether it has a move now (its phase's message, leaving, the round ended)."""
    assert site.site_name is not None
    round_ = session.get(Round, round_id)
    if round_ is None or site.site_name not in round_.participants:  # alike: a site learns no other round's id
        raise NotAParticipant.of_round(site.site_name, round_id)
    if round_.secagg_phase is None:
        raise WrongPhase(f"round {round_id} is not a secure round", code="not_a_secure_round")
    state = round_.secagg_state or {}
    numbers: dict[str, int] = state["sites"]
    own = numbers[site.site_name]
    phase = round_.secagg_phase if round_.status == RoundStatus.OPEN else None
    sent = _sent(session, round_id, site)
    result: dict[str, Any] = {
        "round_id": round_id,
        "status": round_.status,
        "phase": phase,
        "deadline": round_.secagg_deadline_at if phase is not None else None,
        "sent": sent,
    }
    if phase is not None and phase >= SHARE and ADVERTISE in sent:  # a body's `report`, never its `metrics`
        result["peers"] = [
            PeerAdvertisement(site=numbers[name], **body)
            for name, body in senders(session, round_id, ADVERTISE).items()
        ]
    if phase is not None and phase >= MASK and SHARE in sent:
        result["shares"] = [
            RelayedShare(sender=numbers[name], ciphertext=share["ciphertext"])
            for name, body in sorted(senders(session, round_id, SHARE).items())
            for share in body["shares"]
            if share["receiver"] == own
        ]
    if phase is not None and phase >= CONSISTENCY:
        result["survivors"], result["dropped"] = state["survivors"], state["dropped"]
    if phase == REVEAL:
        signed = senders(session, round_id, CONSISTENCY)
        result["signatures"] = {numbers[name]: body["signature"] for name, body in signed.items()}
    found = SecureRoundView.model_validate(result)
    return found, _has_move(found, own)


def _sent(session: Session, round_id: int, site: Principal) -> list[int]:
    """The phases `site` has sent its message of (phase 2: its masked update), read without any other's message."""
    phases = set(
        session.scalars(
            select(SecAggMessage.phase).where(SecAggMessage.round_id == round_id, SecAggMessage.site_id == site.site_id)
        )
    )
    update_id = select(Update.id).where(Update.round_id == round_id, Update.site_id == site.site_id).limit(1)
    if session.scalar(update_id) is not None:
        phases.add(MASK)
    return sorted(phases)


def _has_move(found: SecureRoundView, own: int) -> bool:
    """True unless the site can only wait for others: what site_agent.secure_round.SecureRound.step acts on."""
    phase, sent = found.phase, found.sent
    if phase is None or ADVERTISE not in sent:
        return True  # the round ended; or the site must advertise, or has missed the round and leaves it
    if phase in sent:
        return False
    if phase == MASK:
        return SHARE in sent
    if phase == CONSISTENCY:
        return own in (found.survivors or [])
    if phase == REVEAL:
        return CONSISTENCY in sent
    return True
