"""Opening a round: its kind, its participants as the study's policy picks them, its deadline, its workflow's setup."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.models import Round, RoundKind, RoundStatus, Site, Update
from coordinator.rounds.dispatch import workflow_for
from shared.study.accounting import trained_rounds
from shared.study.rules import select_participants
from shared.terms import StudyTerms

__all__ = ["SYSTEM", "kind_of", "last_round_seconds", "open_round"]

log = logging.getLogger(__name__)
SYSTEM = "system"


def kind_of(terms: StudyTerms, number: int) -> RoundKind:
    """Rounds 1..T train; round T+1 is the final evaluation of theta^g_T (T: fewer when an epsilon budget says so)."""
    return RoundKind.EVALUATE if number > trained_rounds(terms) else RoundKind.TRAIN


def open_round(
    session: Session,
    *,
    study_id: int,
    terms: StudyTerms,
    number: int,
    attempt: int,
    base_sha256: str,
    now: datetime,
    actor: str = SYSTEM,
) -> Round:
    """Add round `number` (attempt `attempt`) with the participants the study's policy picks; caller commits.

    The final evaluation round asks every site, with no load factor: it only evaluates theta^g_T.
    """
    kind = kind_of(terms, number)
    if kind is RoundKind.EVALUATE:
        participants = dict.fromkeys(terms.sites, 1.0)
    else:
        participants = select_participants(terms, number, attempt, lambda: last_round_seconds(session, study_id))
    round_ = Round(
        study_id=study_id,
        number=number,
        attempt=attempt,
        kind=kind,
        status=RoundStatus.OPEN,
        participants=participants,
        base_sha256=base_sha256,
        opened_at=now,
        deadline_at=now + timedelta(seconds=terms.round_deadline_s),
    )
    session.add(round_)
    session.flush()
    workflow_for(terms).start(session, round_, terms)
    audit.record(
        session,
        "round.opened",
        actor=actor,
        study_id=study_id,
        round_id=round_.id,
        digest=base_sha256,
        round=number,
        attempt=attempt,
        kind=kind.value,
        participants=participants,
        deadline_at=round_.deadline_at.isoformat(),
    )
    log.info(
        "study %s: %s round %d (attempt %d) opened for %d site(s), deadline %s",
        study_id,
        kind.value,
        number,
        attempt,
        len(participants),
        round_.deadline_at.isoformat(timespec="seconds"),
        extra={"study": study_id, "round": number},
    )
    return round_


def last_round_seconds(session: Session, study_id: int) -> dict[str, float]:
    """Each site's last measured round time per unit of load factor, over the study's training rounds.

    A round time is from the round's opening to the site's accepted update (download, training and
    upload), divided by the load factor the site trained with; sites never measured are absent.
    """
    rows = session.execute(
        select(Site.name, Update.received_at, Round.opened_at, Round.participants)
        .join(Round, Update.round_id == Round.id)
        .join(Site, Update.site_id == Site.id)
        .where(Round.study_id == study_id, Round.kind == RoundKind.TRAIN)
        .order_by(Round.number, Round.attempt)
    ).all()
    seconds: dict[str, float] = {}
    for site, received_at, opened_at, participants in rows:
        elapsed = max((received_at - opened_at).total_seconds(), 0.0)
        seconds[site] = elapsed / float(participants.get(site, 1.0))
    return seconds
