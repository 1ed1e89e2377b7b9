"""A site's next task: the oldest open round of a running, approved study that selected it and lacks its update.

A secure round is offered only while in phase 0 and until the site advertised its keys: a
restarted agent that lost its round's secrets is not offered the round again (it would advertise
twice); it counts as dropped there and takes the next round.
"""

from __future__ import annotations

from sqlalchemy import and_, exists, or_, select
from sqlalchemy.orm import Session

from coordinator.approvals import approved_study_ids
from coordinator.errors import Unauthenticated
from coordinator.models import GlobalModel, Round, RoundStatus, SecAggMessage, Study, StudyStatus, Token, Update
from coordinator.secure_rounds import ADVERTISE, round_info
from coordinator.security import Principal
from coordinator.study_rules import study_config
from coordinator.views import model_urls
from shared.protocol import PROTOCOL_VERSION, TaskSpec

__all__ = ["next_task"]


def next_task(session: Session, site: Principal) -> TaskSpec | None:
    """The task `site` should work on now, or None; Unauthenticated if its token was revoked meanwhile."""
    assert site.site_id is not None and site.site_name is not None
    if session.scalar(select(Token.revoked_at).where(Token.id == site.token_id)) is not None:
        raise Unauthenticated("token revoked")
    already_sent = exists().where(and_(Update.round_id == Round.id, Update.site_id == site.site_id))
    advertised = exists().where(and_(SecAggMessage.round_id == Round.id, SecAggMessage.site_id == site.site_id))
    joinable = or_(Round.secagg_phase.is_(None), and_(Round.secagg_phase == ADVERTISE, ~advertised))
    candidates = session.execute(
        select(Round, Study)
        .join(Study, Round.study_id == Study.id)
        .where(Round.status == RoundStatus.OPEN, Study.status == StudyStatus.RUNNING, ~already_sent, joinable)
        .order_by(Round.opened_at, Round.id)
    ).all()
    approved = approved_study_ids(session, site.site_id) if candidates else set()
    for round_, study in candidates:
        # A site that has not approved the study is offered none of its tasks: like a silent site, its
        # round closes at the deadline without it (quorum permitting). Its agent declines them anyway.
        if site.site_name in round_.participants and study.id in approved:
            return _task(session, round_, study, site.site_name)
    return None


def _task(session: Session, round_: Round, study: Study, site_name: str) -> TaskSpec:
    config = study_config(study)
    initial = session.scalar(select(GlobalModel).where(GlobalModel.study_id == study.id, GlobalModel.round_number == 0))
    assert initial is not None and initial.local_sha256 is not None  # written when the study started
    global_url, local_url = model_urls(study.id, round_.number - 1)
    return TaskSpec(
        protocol=PROTOCOL_VERSION,
        study_id=study.id,
        study_uid=study.uid,
        round_id=round_.id,
        round=round_.number,
        attempt=round_.attempt,
        kind=round_.kind,
        site=site_name,
        training=config.training,
        load_factor=round_.participants[site_name],
        algorithm=config.algorithm,
        aggregation=config.aggregation,
        model=config.model,
        seed=config.seed,
        rounds=config.rounds,
        participation=config.participation,
        keep_updates=config.keep_updates,
        privacy=config.privacy,
        min_sites=config.min_sites,
        global_model_round=round_.number - 1,
        global_model_sha256=round_.base_sha256,
        global_model_url=global_url,
        initial_local_sha256=initial.local_sha256,
        initial_local_url=local_url,
        update_url=f"/api/v1/rounds/{round_.id}/updates",
        deadline=round_.deadline_at,
        secure=round_info(round_, site_name, config) if round_.secagg_phase is not None else None,
    )
