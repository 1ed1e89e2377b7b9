"""A site's next task: the oldest open round of a running, approved study that selected it and lacks its update.

A task is the study's terms whole and the round attempt's facts, each made by the functions a site
recomputes them with (shared/study/round_terms.py). A round attempt the site declined is not offered again.

Which open rounds may still be offered is each workflow's to say (coordinator/rounds/dispatch.py
`offerable`): a secure round only while in phase 0 and until the site advertised its keys, so a
restarted agent that lost its round's secrets is not offered it again (it would advertise twice).
"""

from __future__ import annotations

from sqlalchemy import and_, exists, select
from sqlalchemy.orm import Session

from coordinator.errors import Unauthenticated
from coordinator.models import (
    GlobalModel,
    Round,
    RoundStatus,
    Study,
    StudyStatus,
    TaskDecline,
    Token,
    Update,
)
from coordinator.rounds.dispatch import offerable, workflow_for
from coordinator.sites.approvals import approved_study_ids
from coordinator.sites.security import Principal
from shared.wire.protocol import PROTOCOL_VERSION, TaskSpec
from shared.wire.urls import decline_url, global_model_url, initial_local_url, update_url

__all__ = ["next_task"]


def next_task(session: Session, site: Principal) -> TaskSpec | None:
    """The task `site` should work on now, or None; Unauthenticated if its token was revoked meanwhile.

    A look reads the candidate rounds' ids and participants, not their studies: a study's terms list
    every site, so decoding them at every poll would cost each site more the more sites there are.
    Only the round it answers with is loaded whole.
    """
    assert site.site_id is not None and site.site_name is not None
    if session.scalar(select(Token.revoked_at).where(Token.id == site.token_id)) is not None:
        raise Unauthenticated("token revoked")
    already_sent = exists().where(and_(Update.round_id == Round.id, Update.site_id == site.site_id))
    declined = exists().where(and_(TaskDecline.round_id == Round.id, TaskDecline.site_id == site.site_id))
    candidates = session.execute(
        select(Round.id, Round.study_id, Round.participants)
        .join(Study, Round.study_id == Study.id)
        .where(
            Round.status == RoundStatus.OPEN,
            Study.status == StudyStatus.RUNNING,
            ~already_sent,
            ~declined,
            offerable(site.site_id),
        )
        .order_by(Round.opened_at, Round.id)
    ).all()
    selected = [
        (round_id, study_id) for round_id, study_id, participants in candidates if site.site_name in participants
    ]
    approved = approved_study_ids(session, site.site_id) if selected else set()
    for round_id, study_id in selected:
        # A site that has not approved the study is offered none of its tasks: like a silent site, its
        # round closes at the deadline without it (quorum permitting). Its agent declines them anyway.
        if study_id in approved:
            round_, study = session.get(Round, round_id), session.get(Study, study_id)
            assert round_ is not None and study is not None
            return _task(session, round_, study, site.site_name)
    return None


def _task(session: Session, round_: Round, study: Study, site_name: str) -> TaskSpec:
    """The task of `round_` for `site_name`: the study's terms whole, and the round attempt's facts."""
    initial = session.scalar(select(GlobalModel).where(GlobalModel.study_id == study.id, GlobalModel.round_number == 0))
    assert initial is not None and initial.local_sha256 is not None  # written when the study started
    return TaskSpec(
        protocol=PROTOCOL_VERSION,
        study_id=study.id,
        study_uid=study.uid,
        site=site_name,
        terms=study.terms,
        round_id=round_.id,
        round=round_.number,
        attempt=round_.attempt,
        kind=round_.kind,
        participants=sorted(round_.participants),
        load_factor=round_.participants[site_name],
        global_model_round=round_.number - 1,
        global_model_sha256=round_.base_sha256,
        global_model_url=global_model_url(study.id, round_.number - 1),
        initial_local_sha256=initial.local_sha256,
        initial_local_url=initial_local_url(study.id),
        update_url=update_url(round_.id),
        decline_url=decline_url(round_.id),
        deadline=round_.deadline_at,
        secure=workflow_for(study.terms).task_setup(study.terms, study.uid, round_, site_name),
    )
