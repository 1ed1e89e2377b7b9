"""Sites that declined their task of a round attempt: recorded once, audited, and left out of what the round waits for.

A site declines a task that disagrees with the terms its operator approved (site_agent/task_check.py).
The coordinator cannot judge the reason; it records it (`task.declined` in the audit trail), offers
that site the round attempt no more, and closes the round without it as soon as every other
selected site has reported (coordinator/rounds/closing.py, coordinator/rounds/secure.py).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.errors import NotAParticipant
from coordinator.models import Round, Site, TaskDecline, Update
from coordinator.sites.security import Principal

__all__ = ["declined_sites", "record_decline", "silent_declines"]


def record_decline(session: Session, *, round_id: int, site: Principal, reason: str, now: datetime) -> bool:
    """Record (and commit) that `site` declines its task of `round_id`; False when it had declined it already."""
    assert site.site_id is not None and site.site_name is not None
    round_ = session.get(Round, round_id)
    if round_ is None or site.site_name not in round_.participants:  # alike: a site learns no other round's id
        raise NotAParticipant.of_round(site.site_name, round_id)
    known = select(TaskDecline.id).where(TaskDecline.round_id == round_id, TaskDecline.site_id == site.site_id)
    if session.scalar(known) is not None:
        session.rollback()
        return False
    session.add(TaskDecline(round_id=round_id, site_id=site.site_id, reason=reason, declined_at=now))
    audit.record(
        session,
        "task.declined",
        actor=site.actor,
        study_id=round_.study_id,
        round_id=round_id,
        site_id=site.site_id,
        reason=reason,
    )
    try:
        session.commit()
    except IntegrityError:  # the same site declined the same round at the same instant
        session.rollback()
        return False
    return True


def declined_sites(session: Session, round_id: int) -> set[str]:
    """The names of the sites that declined their task of `round_id`."""
    rows = session.scalars(
        select(Site.name).join(TaskDecline, TaskDecline.site_id == Site.id).where(TaskDecline.round_id == round_id)
    )
    return set(rows)


def silent_declines(session: Session, round_id: int) -> int:
    """How many sites declined `round_id` without having sent an update to it: the round waits for none of them."""
    uploaded = exists().where(and_(Update.round_id == TaskDecline.round_id, Update.site_id == TaskDecline.site_id))
    rows = session.scalars(select(TaskDecline.id).where(TaskDecline.round_id == round_id, ~uploaded))
    return len(list(rows))
