"""Read models: studies, rounds with per-site and pooled summaries, global models, the status summary."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.models import Blob, GlobalModel, Round, RoundKind, RoundStatus, Site, Study, StudyStatus, Update
from coordinator.sites.approvals import APPROVED, AWAITING, DECLINED, approval_states
from shared.evaluation.summaries import pooled_summaries
from shared.study.accounting import privacy_report
from shared.study.rules import study_exchange
from shared.wire.api import (
    GlobalModelPublic,
    RoundPublic,
    SiteStatus,
    StatusReport,
    StudyPublic,
    StudyStatusLine,
    TransferProgress,
    UpdatePublic,
)
from shared.wire.urls import global_model_url, initial_local_url

__all__ = ["evaluator_round", "global_models", "round_view", "rounds_view", "status_report", "study_view"]

ACTIVE = (RoundStatus.OPEN, RoundStatus.AGGREGATING)


def _latest_global(session: Session, study_id: int) -> GlobalModel | None:
    return session.scalar(
        select(GlobalModel).where(GlobalModel.study_id == study_id).order_by(GlobalModel.round_number.desc()).limit(1)
    )


def _active_round(session: Session, study_id: int) -> Round | None:
    return session.scalar(
        select(Round).where(Round.study_id == study_id, Round.status.in_(ACTIVE)).order_by(Round.id.desc()).limit(1)
    )


def study_view(session: Session, study: Study) -> StudyPublic:
    """A study and where it stands."""
    latest = _latest_global(session, study.id)
    active = _active_round(session, study.id)
    config = study.terms
    return StudyPublic(
        id=study.id,
        uid=study.uid,
        name=study.name,
        status=study.status,
        config=config,
        created_by=study.created_by,
        created_at=study.created_at,
        updated_at=study.updated_at,
        completed_rounds=latest.round_number if latest is not None else 0,
        current_round=active.number if active is not None else None,
        latest_global_sha256=latest.sha256 if latest is not None else None,
        approvals=approval_states(session, study),
        privacy=privacy_report(config, latest.round_number if latest is not None else 0),
    )


def rounds_view(session: Session, study: Study) -> list[RoundPublic]:
    """Every round attempt of the study, oldest first."""
    rounds = session.scalars(select(Round).where(Round.study_id == study.id).order_by(Round.number, Round.attempt))
    return [round_view(session, study, round_) for round_ in rounds]


def _update_rows(session: Session, round_id: int) -> list[tuple[Update, str]]:
    return [
        (u, name)
        for u, name in session.execute(
            select(Update, Site.name)
            .join(Site, Update.site_id == Site.id)
            .where(Update.round_id == round_id)
            .order_by(Site.name)
        ).all()
    ]


def _pooled(study: Study, round_: Round, rows: list[tuple[Update, str]]) -> dict[str, Any] | None:
    """Pooled summaries: stored at completion, computed while the round is open."""
    if round_.pooled is not None:
        return round_.pooled
    if not rows:
        return None
    config = study.terms
    pooled = pooled_summaries(((u.num_examples, u.metrics) for u, _ in rows), config.model.config().n_classes)
    return {**pooled, "global_label": study_exchange(config).global_label()}


def evaluator_round(session: Session, round_: Round) -> Round | None:
    """The attempt of round t+1 whose sites reported statistics of this round's theta^g_t."""
    if round_.status != RoundStatus.COMPLETED or round_.kind == RoundKind.EVALUATE:
        return None
    return session.scalar(
        select(Round)
        .where(Round.study_id == round_.study_id, Round.number == round_.number + 1)
        .order_by((Round.status == RoundStatus.COMPLETED).desc(), Round.attempt.desc())
        .limit(1)
    )


def round_view(session: Session, study: Study, round_: Round) -> RoundPublic:
    """One round attempt with its updates and pooled summaries.

    `local_eval` is each site's personalised model after this round's training. `eval` is the
    global evaluation model theta^g_t that this round produced (with phi_0): sites evaluate it when
    they receive it, in round t+1 or in the final evaluation round, so it fills in then.
    """
    rows = _update_rows(session, round_.id)
    evaluator = evaluator_round(session, round_)
    evaluator_rows = _update_rows(session, evaluator.id) if evaluator is not None else []
    evaluations = {name: u.summary.get("eval") for u, name in evaluator_rows}
    updates = [
        UpdatePublic(
            site=name,
            num_examples=u.num_examples,
            sha256=u.sha256,
            size=u.size,
            weight=u.weight,
            train_seconds=u.train_seconds,
            received_at=u.received_at,
            train_loss=u.summary["train_loss"],
            eval=evaluations.get(name),
            local_eval=u.summary.get("local_eval"),
            base_round=u.base_round,
            staleness=None if u.base_round is None else round_.number - 1 - u.base_round,
        )
        for u, name in rows
    ]
    pooled = dict(_pooled(study, round_, rows) or {})
    if pooled:
        evaluated = _pooled(study, evaluator, evaluator_rows) if evaluator is not None else None
        pooled["eval"] = evaluated.get("eval") if evaluated else None
    result = session.scalar(select(GlobalModel.sha256).where(GlobalModel.round_id == round_.id))
    base_size = session.scalar(select(Blob.size).where(Blob.sha256 == round_.base_sha256))
    return RoundPublic(
        id=round_.id,
        study_id=round_.study_id,
        number=round_.number,
        attempt=round_.attempt,
        kind=round_.kind,
        status=round_.status,
        participants=round_.participants,
        opened_at=round_.opened_at,
        deadline_at=round_.deadline_at,
        closed_at=round_.closed_at,
        note=round_.note,
        base_sha256=round_.base_sha256,
        base_size=base_size,
        global_model_sha256=result,
        updates=updates,
        pooled=pooled or None,
    )


def global_models(session: Session, study_id: int) -> list[GlobalModelPublic]:
    """The study's stored theta^g_t, t = 0 first."""
    rows = session.execute(
        select(GlobalModel, Blob.size)
        .join(Blob, GlobalModel.sha256 == Blob.sha256)
        .where(GlobalModel.study_id == study_id)
        .order_by(GlobalModel.round_number)
    ).all()
    views = []
    for model, size in rows:
        views.append(
            GlobalModelPublic(
                round=model.round_number,
                sha256=model.sha256,
                size=size,
                local_sha256=model.local_sha256,
                created_at=model.created_at,
                url=global_model_url(study_id, model.round_number),
                local_url=initial_local_url(study_id) if model.local_sha256 is not None else None,
            )
        )
    return views


# (bytes held, size) of each upload session under way, by (round id, site id): UploadSessions.held
HeldUploads = Mapping[tuple[int, int], tuple[int, int]]
# (bytes sent, size) of each model download under way, by (study id, site id): DownloadsUnderWay.held
SentDownloads = Mapping[tuple[int, int], tuple[int, int]]


def _transfers(
    round_: Round, site_ids: Mapping[str, int], reported: set[str], held: HeldUploads, sent: SentDownloads
) -> dict[str, list[TransferProgress]]:
    """The transfers of open round `round_` under way, by site: models going out and updates still arriving."""
    progress: dict[str, list[TransferProgress]] = {}
    for name in sorted(set(round_.participants) - reported):  # an update accepted is no transfer any more
        site_id = site_ids.get(name, -1)
        for direction, (done, total) in (
            ("download", sent.get((round_.study_id, site_id), (-1, 0))),
            ("upload", held.get((round_.id, site_id), (-1, 0))),
        ):
            if done >= 0:
                progress.setdefault(name, []).append(
                    TransferProgress(
                        study_id=round_.study_id,
                        round=round_.number,
                        round_id=round_.id,
                        direction=direction,
                        bytes_done=done,
                        bytes_total=total,
                    )
                )
    return progress


def status_report(
    session: Session, now: datetime, uploads: HeldUploads | None = None, downloads: SentDownloads | None = None
) -> StatusReport:
    """Studies with their current round, round counts by status, and every site's last contact and task.

    `uploads` (UploadSessions.held) and `downloads` (DownloadsUnderWay.held): the transfers under way, shown
    as each site's in the study's open round.
    """
    studies = session.scalars(select(Study).order_by(Study.id)).all()
    sites = session.scalars(select(Site).order_by(Site.name)).all()
    site_ids = {site.name: site.id for site in sites}
    lines: list[StudyStatusLine] = []
    tasks: dict[str, dict[str, int]] = {}  # site -> the task it should be working on
    transfers: dict[str, list[TransferProgress]] = {}  # site -> its transfers under way
    for study in studies:
        config = study.terms
        states = approval_states(session, study, config.sites)
        awaiting = sorted(name for name, state in states.items() if state == AWAITING)
        declined = sorted(name for name, state in states.items() if state == DECLINED)
        latest = _latest_global(session, study.id)
        active = _active_round(session, study.id)
        received = None
        if active is not None:
            reported = set(
                session.scalars(
                    select(Site.name).join(Update, Update.site_id == Site.id).where(Update.round_id == active.id)
                )
            )
            received = len(reported)
            if active.status == RoundStatus.OPEN and (uploads or downloads):  # a paused study's round takes updates
                for name, moving in _transfers(active, site_ids, reported, uploads or {}, downloads or {}).items():
                    transfers.setdefault(name, []).extend(moving)
            if active.status == RoundStatus.OPEN and study.status == StudyStatus.RUNNING:
                unapproved = {name for name, state in states.items() if state != APPROVED}  # offered no task
                for site in set(active.participants) - reported - unapproved:
                    tasks.setdefault(site, {"study_id": study.id, "round": active.number, "round_id": active.id})
        lines.append(
            StudyStatusLine(
                id=study.id,
                name=study.name,
                status=study.status,
                rounds=config.rounds,
                completed_rounds=latest.round_number if latest is not None else 0,
                current_round=active.number if active is not None else None,
                round_status=active.status if active is not None else None,
                updates_received=received,
                participants=len(active.participants) if active is not None else None,
                awaiting_approval=awaiting,
                declined=declined,
            )
        )
    counts = dict(session.execute(select(Round.status, func.count()).group_by(Round.status)).all())
    views = [
        SiteStatus(
            name=site.name,
            last_seen_at=site.last_seen_at,
            current_task=tasks.get(site.name),
            transfers=transfers.get(site.name, []),
        )
        for site in sites
    ]
    return StatusReport(
        time=now, studies=lines, rounds={s.value: counts.get(s.value, 0) for s in RoundStatus}, sites=views
    )
