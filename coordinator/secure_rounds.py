"""Secure rounds (SecAgg+): the phases of an open round, relayed through the database, and the unmasked sum.

A secure round stays `open` while `rounds.secagg_phase` walks 0 -> 1 -> 2 -> 3; then the round
engine aggregates it as any round (coordinator/rounds.py). Each phase ends when every site
expected in it has sent its message, or at `rounds.secagg_deadline_at` (phase 0: the round's
deadline, since sites train before they advertise; later phases: `phase_timeout_s` after the
previous one closed) with at least the round's quorum max(min_sites, t + 1) (study_secagg.round_quorum):

0. advertise: a participant sends its two X25519 public keys, n_k and its scalar metrics
   (`secagg_messages` phase 0). Closing fixes w_k over the advertisers (aggregation_weights).
1. share: an advertiser sends its sealed Shamir shares, one per neighbour that advertised (phase 1).
2. mask: a site that shared uploads its masked ring vector as an ordinary update whose blob holds
   only `secagg.masked` (coordinator/updates.py). Closing fixes the survivors (uploaders) and the
   dropped (shared, then sent nothing).
3. reveal: survivors send the shares the unmasking needs (phase 3); closing hands the round to
   the engine, which sums the stored masked blobs one at a time into one uint64 accumulator,
   removes the masks (shared.privacy.server.ServerState.unmask) and decodes the survivors' sums, which
   the algorithm's server step turns into theta^g_t (coordinator/rounds.py).

Everything lives in the database: `rounds.secagg_state` (the public setup, then the weights and
the unmask request) and `secagg_messages`; a ServerState is rebuilt from them when needed. Every
phase change is a conditional UPDATE on (status open, the phase), taken with the round row locked,
so one worker wins it and a restarted coordinator carries on. Below quorum a phase fails the
round with its reason and the retry policy opens a new attempt; too few reveals fail the
aggregation the same way. The coordinator never holds an unmasked individual update.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel
from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from coordinator import audit
from coordinator.blob_store import BlobStore
from coordinator.blobs import open_blobs
from coordinator.declines import declined_sites
from coordinator.errors import (
    Forbidden,
    InvalidSecAggMessage,
    InvalidUpload,
    NotAParticipant,
    NotFound,
    RoundClosed,
    WrongPhase,
)
from coordinator.models import Round, RoundKind, RoundStatus, SecAggMessage, Site, Study, Update
from coordinator.security import Principal
from shared.algorithms.weightings import aggregation_weights
from shared.partition import TensorSpec
from shared.privacy.errors import PrivacyError
from shared.privacy.masking import MaskStreams
from shared.privacy.messages import EncryptedShare, KeyAdvertisement, RoundSetup, ShareReveal
from shared.privacy.server import ServerState
from shared.privacy.shamir import Share
from shared.privacy.study_secagg import (
    SecureLayout,
    SecureSumDecoded,
    decode_sum,
    round_quorum,
    site_numbers,
    survivor_weight_sum,
)
from shared.round_terms import secure_round_key, secure_setup
from shared.study import secure_layout as study_layout
from shared.tensors import read_header
from shared.terms import StudyTerms
from shared.wire.secure import MASKED_TENSOR, PeerKeys, RelayedShare, SecureRoundView, from_b64

__all__ = [
    "ADVERTISE",
    "MASK",
    "REVEAL",
    "SHARE",
    "PhaseStep",
    "advance",
    "check_advertised",
    "check_masked_upload",
    "look",
    "masked_schema",
    "receive",
    "secure_layout",
    "start",
    "unmasked_sums",
    "view",
]

ADVERTISE, SHARE, MASK, REVEAL = 0, 1, 2, 3
PHASE_NAMES = ("advertise", "share", "mask", "reveal")


@dataclass(frozen=True)
class PhaseStep:
    """What closing a secure round's phase led to: the next phase, the aggregation, or a failure and why."""

    moved_to: str | None = None  # the name of the phase the round moved on to
    aggregate: bool = False  # phase 3 closed: unmask and aggregate
    failure: str | None = None  # below quorum, or the phase could not close: the round fails with this reason


_WINDOW = 1 << 17  # ring elements of every masked blob summed and unmasked at a time (1 MiB each)


def start(session: Session, round_: Round, config: StudyTerms) -> None:
    """Make a just-flushed round of a secure study secure: phase 0 until the round's deadline, its public setup.

    The setup is what every site derives from the terms and (study uid, round, attempt, participants)
    itself (shared/round_terms.py `secure_setup`); the stored copy spares recomputing it.
    """
    uid = session.scalar(select(Study.uid).where(Study.id == round_.study_id))
    assert uid is not None
    setup = secure_setup(
        config, study_uid=uid, number=round_.number, attempt=round_.attempt, participants=list(round_.participants)
    )
    round_.secagg_phase = ADVERTISE
    round_.secagg_deadline_at = round_.deadline_at
    round_.secagg_state = {
        "study_uid": uid,
        "sites": site_numbers(list(round_.participants)),
        "graph_seed": setup.graph_seed.hex(),
        "neighbour_count": setup.neighbour_count,
        "threshold": setup.threshold,
        "min_survivors": setup.min_survivors,
    }


def setup_of(round_: Round) -> RoundSetup:
    """The round's public setup, from its stored state."""
    state = round_.secagg_state or {}
    return RoundSetup(
        study_uid=state["study_uid"],
        round_no=secure_round_key(round_.number, round_.attempt),
        sites=tuple(sorted(state["sites"].values())),
        graph_seed=bytes.fromhex(state["graph_seed"]),
        neighbour_count=state["neighbour_count"],
        threshold=state["threshold"],
        min_survivors=state["min_survivors"],
    )


def secure_layout(config: StudyTerms, kind: str) -> SecureLayout:
    """The ring vector's layout of a round of `kind` (the final evaluation sums statistics only)."""
    secure = config.privacy.secure_aggregation
    assert secure is not None
    return study_layout(
        config.model, config.algorithm, train=kind == RoundKind.TRAIN, fraction_bits=secure.fraction_bits
    )


def masked_schema(config: StudyTerms, kind: str) -> dict[str, TensorSpec]:
    """What a secure round's update holds: the masked ring vector, as int64 words."""
    return {MASKED_TENSOR: TensorSpec((secure_layout(config, kind).length,), torch.int64)}


# -- the sites' messages -----------------------------------------------------------------------------------


def _locked_round(session: Session, round_id: int) -> Round:
    round_ = session.scalar(select(Round).where(Round.id == round_id).with_for_update())
    if round_ is None:
        raise NotFound(f"round {round_id}")
    if round_.secagg_phase is None:
        raise WrongPhase(f"round {round_id} is not a secure round", code="not_a_secure_round")
    return round_


def _senders(session: Session, round_id: int, phase: int) -> dict[str, dict[str, Any]]:
    """Site name -> message body of every message of `phase` (phase 2: the masked updates' sha256)."""
    if phase == MASK:
        rows = session.execute(
            select(Site.name, Update.sha256).join(Site, Update.site_id == Site.id).where(Update.round_id == round_id)
        ).all()
        return {name: {"sha256": digest} for name, digest in rows}
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
    if site.site_name not in round_.participants:
        raise NotAParticipant(f"site {site.site_name!r} was not selected for round {round_id}")
    body = message.model_dump(mode="json")
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
    config = session.get(Study, round_.study_id).terms
    _check(session, round_, config, site.site_name, phase, body, max_num_examples)
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
    if site_name not in _senders(session, round_.id, SHARE):
        raise Forbidden(
            f"site {site_name!r} sent no shares in phase 1, so it takes no further part in round {round_.id}",
            code="not_in_phase",
        )


def check_advertised(session: Session, round_id: int, site_name: str, num_examples: int) -> None:
    """InvalidUpload unless the masked update's n_k is the one the site advertised in phase 0."""
    advertised = _senders(session, round_id, ADVERTISE).get(site_name, {}).get("num_examples")
    session.rollback()
    if advertised != num_examples:
        raise InvalidUpload(
            f"n_k = {num_examples} differs from the {advertised} advertised in phase 0", code="invalid_update_meta"
        )


def _check(
    session: Session, round_: Round, config: StudyTerms, name: str, phase: int, body: dict[str, Any], max_n: int
) -> None:
    """InvalidSecAggMessage when the message breaks the protocol, replayed through a ServerState."""
    number = (round_.secagg_state or {})["sites"][name]
    try:
        if phase == ADVERTISE:
            if body["num_examples"] > max_n:
                raise ValueError(f"n_k = {body['num_examples']} exceeds the plausible maximum {max_n}")
            aggregation_weights(  # what the weighting reads (uncertainty: H_k) must be there now
                [body["num_examples"]], config.aggregation.name, config.aggregation.params, metrics=[body["metrics"]]
            )
            return
        # Only the phases before this one: the sender's own earlier message of it is refused upstream
        # (duplicate_message), so the other sites' messages of this phase need not be replayed.
        server = _replay(session, round_, through=phase - 1)
        if phase == SHARE:
            server.receive_shares(number, _sealed(number, body))
        elif phase == REVEAL:
            server.receive_reveal(_reveal(number, body))
    except (PrivacyError, ValueError) as exc:
        raise InvalidSecAggMessage(f"{PHASE_NAMES[phase]} message refused: {exc}") from None


def _sealed(number: int, body: dict[str, Any]) -> list[EncryptedShare]:
    return [EncryptedShare(number, share["receiver"], from_b64(share["ciphertext"])) for share in body["shares"]]


def _reveal(number: int, body: dict[str, Any]) -> ShareReveal:
    return ShareReveal(
        number,
        self_mask_shares={int(o): Share(number, int(y, 16)) for o, y in body["self_mask_shares"].items()},
        mask_key_shares={int(o): Share(number, int(y, 16)) for o, y in body["mask_key_shares"].items()},
    )


def _replay(session: Session, round_: Round, through: int = REVEAL) -> ServerState:
    """A ServerState of the messages stored so far, up to the round's phase and `through` (inputs: who sent one)."""
    numbers: dict[str, int] = (round_.secagg_state or {})["sites"]
    last = min(round_.secagg_phase if round_.secagg_phase is not None else ADVERTISE, through)
    server = ServerState(setup_of(round_))
    for name, body in sorted(_senders(session, round_.id, ADVERTISE).items()):
        ad = KeyAdvertisement(numbers[name], from_b64(body["cipher_public"]), from_b64(body["mask_public"]))
        server.receive_advertisement(ad)
    if last < SHARE:
        return server
    for name, body in sorted(_senders(session, round_.id, SHARE).items()):
        server.receive_shares(numbers[name], _sealed(numbers[name], body))
    if last < MASK:
        return server
    for name in sorted(_senders(session, round_.id, MASK)):
        server.note_masked_input(numbers[name])
    if last < REVEAL:
        return server
    for name, body in sorted(_senders(session, round_.id, REVEAL).items()):
        server.receive_reveal(_reveal(numbers[name], body))
    return server


def view(session: Session, round_id: int, site: Principal) -> SecureRoundView:
    """What `site` may see of the round now: its phase, its weight, and what is relayed to it."""
    return look(session, round_id, site)[0]


def look(session: Session, round_id: int, site: Principal) -> tuple[SecureRoundView, bool]:
    """The site's view of the round, and whether it has a move now (its phase's message, leaving, the round ended)."""
    assert site.site_name is not None
    round_ = session.get(Round, round_id)
    if round_ is None:
        raise NotFound(f"round {round_id}")
    if round_.secagg_phase is None:
        raise WrongPhase(f"round {round_id} is not a secure round", code="not_a_secure_round")
    if site.site_name not in round_.participants:
        raise NotAParticipant(f"site {site.site_name!r} was not selected for round {round_id}")
    state = round_.secagg_state or {}
    numbers: dict[str, int] = state["sites"]
    own = numbers[site.site_name]
    phase = round_.secagg_phase if round_.status == RoundStatus.OPEN else None
    sent = [p for p in (ADVERTISE, SHARE, MASK, REVEAL) if site.site_name in _senders(session, round_id, p)]
    result: dict[str, Any] = {
        "round_id": round_id,
        "status": round_.status,
        "phase": phase,
        "deadline": round_.secagg_deadline_at if phase is not None else None,
        "weight": state.get("weights", {}).get(site.site_name),
        "sent": sent,
    }
    if phase is not None and phase >= SHARE and ADVERTISE in sent:
        neighbours = setup_of(round_).neighbours(own)
        result["peers"] = [
            PeerKeys(site=numbers[name], cipher_public=body["cipher_public"], mask_public=body["mask_public"])
            for name, body in sorted(_senders(session, round_id, ADVERTISE).items())
            if numbers[name] in neighbours
        ]
    if phase is not None and phase >= MASK and SHARE in sent:
        result["shares"] = [
            RelayedShare(sender=numbers[name], ciphertext=share["ciphertext"])
            for name, body in sorted(_senders(session, round_id, SHARE).items())
            for share in body["shares"]
            if share["receiver"] == own
        ]
    if phase == REVEAL:
        result["survivors"], result["dropped"] = state["survivors"], state["dropped"]
    found = SecureRoundView.model_validate(result)
    return found, _has_move(found, own)


def _has_move(found: SecureRoundView, own: int) -> bool:
    """True unless the site can only wait for others: what site_agent.secure_round.SecureRound.step acts on."""
    phase, sent = found.phase, found.sent
    if phase is None or ADVERTISE not in sent:
        return True  # the round ended; or the site must advertise, or has missed the round and leaves it
    if phase in sent:
        return False
    if phase == MASK:
        return SHARE in sent
    if phase == REVEAL:
        return own in (found.survivors or [])
    return True


# -- phase changes ------------------------------------------------------------------------------------------


def advance(sessions: sessionmaker[Session], round_id: int, *, now: datetime) -> PhaseStep | None:
    """Close the current phase when it is due (None when nothing was due or another worker closed it)."""
    with sessions() as session:
        round_ = session.scalar(select(Round).where(Round.id == round_id).with_for_update())
        if round_ is None or round_.status != RoundStatus.OPEN or round_.secagg_phase is None:
            session.rollback()
            return None
        config = session.get(Study, round_.study_id).terms
        phase, state = round_.secagg_phase, dict(round_.secagg_state or {})
        expected = _expected(session, round_, phase, state)
        got = _senders(session, round_id, phase)
        due = round_.secagg_deadline_at is not None and now >= round_.secagg_deadline_at
        if not (expected <= got.keys() or due):
            session.rollback()
            return None
        if phase == REVEAL:
            session.rollback()
            return PhaseStep(aggregate=True)  # too few reveals: the unmasking fails the aggregation with the reason
        quorum = round_quorum(config.min_sites, state["min_survivors"])
        if len(got) < quorum:
            session.rollback()
            return PhaseStep(
                failure=f"secure aggregation, phase {PHASE_NAMES[phase]}: {len(got)} of {len(expected)} sites, "
                f"{quorum} needed"
            )
        try:
            state.update(_closing(phase, got, expected, state, config))
        except ValueError as exc:
            session.rollback()
            return PhaseStep(failure=f"secure aggregation, phase {PHASE_NAMES[phase]}: {exc}")
        secure = config.privacy.secure_aggregation
        assert secure is not None
        moved = session.execute(
            update(Round)
            .where(Round.id == round_id, Round.status == RoundStatus.OPEN, Round.secagg_phase == phase)
            .values(
                secagg_phase=phase + 1,
                secagg_deadline_at=now + timedelta(seconds=secure.phase_timeout_s),
                secagg_state=state,
            )
        )
        if moved.rowcount != 1:
            session.rollback()
            return None
        audit.record(
            session,
            "round.secagg_phase",
            actor="system",
            study_id=round_.study_id,
            round_id=round_id,
            phase=phase + 1,
            sites=sorted(got),
        )
        session.commit()
    return PhaseStep(moved_to=PHASE_NAMES[phase + 1])


def _expected(session: Session, round_: Round, phase: int, state: dict[str, Any]) -> set[str]:
    """The sites whose message of `phase` closes it early: those still in the round that have not declined it."""
    if phase == ADVERTISE:
        expected = set(round_.participants)
    elif phase == REVEAL:
        names = {number: name for name, number in state["sites"].items()}
        expected = {names[number] for number in state["survivors"]}
    else:
        expected = set(_senders(session, round_.id, phase - 1))  # share: the advertisers; mask: the sites that shared
    return expected - declined_sites(session, round_.id)


def _closing(
    phase: int, got: dict[str, dict[str, Any]], expected: set[str], state: dict[str, Any], config: StudyTerms
) -> dict[str, Any]:
    """What closing `phase` fixes: the weights (advertise) or the unmask request (mask)."""
    if phase == ADVERTISE:
        names = sorted(got)
        weights = aggregation_weights(
            [got[name]["num_examples"] for name in names],
            config.aggregation.name,
            config.aggregation.params,
            metrics=[got[name]["metrics"] for name in names],
        )
        return {"weights": dict(zip(names, weights, strict=True))}
    if phase == MASK:
        numbers: dict[str, int] = state["sites"]
        dropped = expected - got.keys()  # shared their secrets, then sent no masked vector
        return {"survivors": sorted(numbers[name] for name in got), "dropped": sorted(numbers[n] for n in dropped)}
    return {}


# -- the unmasked sum ---------------------------------------------------------------------------------------


def unmasked_sums(
    sessions: sessionmaker[Session], engine: Engine, store: BlobStore | None, round_id: int, config: StudyTerms
) -> tuple[SecureSumDecoded, dict[str, float]]:
    """The survivors' decoded sums and statistics, and each survivor's weight renormalised over them."""
    with sessions() as session:
        round_ = session.get(Round, round_id)
        assert round_ is not None
        server = _replay(session, round_)
        layout = secure_layout(config, round_.kind)
        masked = sorted(_senders(session, round_id, MASK).items())
        weights: dict[str, float] = (round_.secagg_state or {})["weights"]
        session.rollback()
    total = np.empty(layout.length, dtype=np.uint64)
    _sum_and_unmask(engine, store, [body["sha256"] for _, body in masked], total, MaskStreams(server.removal_masks()))
    survivors = [name for name, _ in masked]
    weight_sum = survivor_weight_sum(weights, survivors)
    decoded = decode_sum(layout, total, weight_sum, len(survivors))
    return decoded, {name: weights[name] / weight_sum for name in survivors}


def _sum_and_unmask(
    engine: Engine, store: BlobStore | None, digests: list[str], total: np.ndarray, masks: MaskStreams
) -> None:
    """Write into `total` the sum in Z_{2^64} of the stored masked vectors `digests`, minus `masks`.

    One pass, a window at a time: each window of every blob is added, then the window of every
    mask removed, while the window is still in the CPU cache.
    """
    if not digests:
        raise ValueError("no masked vector to sum")
    with open_blobs(engine, digests, store=store) as readers:
        starts = []
        for digest, reader in zip(digests, readers, strict=True):
            length = int.from_bytes(bytes(reader.read(0, 8)), "little")
            header = read_header(bytes(reader.read(0, 8 + length)), total_size=reader.size)
            begin, _ = header.offsets[MASKED_TENSOR]
            if header.specs[MASKED_TENSOR].shape != total.shape:
                raise ValueError(f"masked update {digest} does not fit the round's layout")
            starts.append(header.data_start + begin)
        for first in range(0, total.size, _WINDOW):
            window = total[first : first + _WINDOW]
            for number, (reader, start) in enumerate(zip(readers, starts, strict=True)):
                words = np.frombuffer(reader.read(start + 8 * first, 8 * window.size), dtype="<u8")
                if number == 0:
                    window[...] = words
                else:
                    np.add(window, words, out=window)
            masks.apply(window)
