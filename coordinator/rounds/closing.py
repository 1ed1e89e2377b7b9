"""Closing a round: due, aggregated under a lease, finished (theta^g_t, the next round), or failed and retried.

Every transition is a conditional UPDATE on `rounds.status` (and, while aggregating, on the
worker's lease), so exactly one worker wins it. What is due and how a round sums is its workflow's
(coordinator/rounds/workflow.py: plain.py or secure.py); this module is the one lifecycle around
it. A worker killed mid-aggregation leaves the round `aggregating`; once its lease expires another
worker recomputes it from the same stored updates, so nothing is lost or counted twice.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import func, select, update
from sqlalchemy.engine import CursorResult  # an UPDATE's result, which Session.execute types as a Result
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from coordinator import audit
from coordinator.db import DOWNLOAD_CACHE, utc_now
from coordinator.models import GlobalModel, Round, RoundKind, RoundStatus, Site, Study, StudyStatus, Update
from coordinator.rounds.dispatch import workflow_for
from coordinator.rounds.job_studies import settle_job_studies
from coordinator.rounds.opening import SYSTEM, open_round
from coordinator.rounds.workflow import Aggregated, Contribution
from coordinator.serving.process import release_free_heap
from coordinator.storage.blobs import put_blob
from coordinator.storage.download_cache import BlobCache
from coordinator.storage.retention import release_updates
from coordinator.storage.update_files import StoredBlobError
from shared.evaluation.summaries import pooled_summaries
from shared.logs import log_context
from shared.study.accounting import privacy_report
from shared.study.rules import study_exchange
from shared.tensors.codec import PayloadError
from shared.terms import StudyTerms

__all__ = ["aggregate_round", "close_round_if_ready", "tick"]

log = logging.getLogger(__name__)


def close_round_if_ready(
    sessions: sessionmaker[Session], round_id: int, *, now: datetime, lease_s: float
) -> RoundStatus | None:
    """Do what is due in an open round of a running study: its workflow's next step, its aggregation, or its failure.

    Returns the status the round reached through this call, or None when nothing was due or
    another worker won the transition.
    """
    with sessions() as session:
        round_ = session.get(Round, round_id)
        if round_ is None or round_.status != RoundStatus.OPEN:
            return None
        study = session.get(Study, round_.study_id)
        if study is None or study.status != StudyStatus.RUNNING:
            return None
        workflow = workflow_for(study.terms)
        about = {"study": study.id, "round": round_.number}  # what this round's log lines carry (JSON logs)
        session.rollback()
    with log_context(**about):
        step = workflow.step(sessions, round_id, now=now)
        if step is not None and step.aggregate:
            return RoundStatus.COMPLETED if aggregate_round(sessions, round_id, now=now, lease_s=lease_s) else None
        if step is not None and step.failure is not None:
            failed = _fail_round(sessions, round_id, now=now, reason=step.failure, quorum_rescues=step.rescuable)
            return RoundStatus.FAILED if failed else None
    return None


def _fail_round(
    sessions: sessionmaker[Session], round_id: int, *, now: datetime, reason: str, quorum_rescues: bool = True
) -> bool:
    """Move open -> failed; then retry the round as a new attempt, or fail the study when retries are spent.

    The round row is locked first, so an upload being stored right now either finishes before the
    count (and may lift the round to quorum: then nothing fails) or finds the round failed. A
    secure round's phase below quorum (`quorum_rescues` False) fails whatever updates it holds.
    """
    with sessions() as session:
        round_ = session.scalar(select(Round).where(Round.id == round_id).with_for_update())
        study = session.get(Study, round_.study_id) if round_ is not None else None
        if round_ is None or study is None or round_.status != RoundStatus.OPEN:
            session.rollback()
            return False
        terms = study.terms
        reported = session.scalar(select(func.count()).select_from(Update).where(Update.round_id == round_id)) or 0
        if quorum_rescues and reported >= terms.min_sites:  # an update arrived meanwhile: the next check aggregates
            session.rollback()
            return False
        failed = cast(
            "CursorResult[Any]",
            session.execute(
                update(Round)
                .where(Round.id == round_id, Round.status == RoundStatus.OPEN)
                .values(status=RoundStatus.FAILED, closed_at=now, note=reason)
            ),
        )
        if failed.rowcount != 1:
            session.rollback()
            return False
        session.refresh(round_)
        _after_failure(session, round_, study, terms, reason=reason, now=now)
        session.commit()
        release_updates(session, round_ids=[round_id])  # its stored files are not needed now
        return True


def _fail_aggregation(
    sessions: sessionmaker[Session], round_id: int, lease: str, *, now: datetime, reason: str
) -> bool:
    """Move aggregating -> failed, for a reason that a retry of the aggregation would meet again.

    The round's retry policy then applies as for a missed quorum: a new attempt, where the sites
    upload again, or the study fails.
    """
    with sessions() as session:
        failed = cast(
            "CursorResult[Any]",
            session.execute(
                update(Round)
                .where(Round.id == round_id, Round.status == RoundStatus.AGGREGATING, Round.aggregation_lease == lease)
                .values(status=RoundStatus.FAILED, closed_at=now, note=reason[:500])
            ),
        )
        if failed.rowcount != 1:
            session.rollback()
            return False
        round_ = session.get(Round, round_id)
        study = session.get(Study, round_.study_id) if round_ is not None else None
        assert round_ is not None and study is not None
        _after_failure(session, round_, study, study.terms, reason=reason, now=now)
        session.commit()
        release_updates(session, round_ids=[round_id])  # its stored files are not needed now
    return True


def _after_failure(
    session: Session, round_: Round, study: Study, terms: StudyTerms, *, reason: str, now: datetime
) -> None:
    """Audit a failed round, then retry it as a new attempt, or end the study when retries are spent."""
    audit.record(
        session,
        "round.failed",
        actor=SYSTEM,
        study_id=study.id,
        round_id=round_.id,
        round=round_.number,
        reason=reason,
    )
    if round_.kind == RoundKind.EVALUATE:
        _set_study_status(
            session,
            study,
            StudyStatus.COMPLETED,
            now=now,
            rounds=round_.number - 1,
            note=f"final evaluation incomplete: {reason}",
        )
    elif round_.attempt <= terms.round_retries:
        open_round(
            session,
            study_id=study.id,
            terms=terms,
            number=round_.number,
            attempt=round_.attempt + 1,
            base_sha256=round_.base_sha256,
            now=now,
        )
    else:
        _set_study_status(session, study, StudyStatus.FAILED, reason=f"round {round_.number}: {reason}", now=now)


def _set_study_status(session: Session, study: Study, status: StudyStatus, *, now: datetime, **detail: Any) -> None:
    study.status = status
    study.updated_at = now
    audit.record(session, f"study.{status.value}", actor=SYSTEM, study_id=study.id, **detail)


def aggregate_round(sessions: sessionmaker[Session], round_id: int, *, now: datetime, lease_s: float) -> bool:
    """Claim the round (open, or aggregating with an expired lease), aggregate it, and commit the result.

    True when this call stored theta^g_t; False when another worker holds or finished the round, or
    when the aggregation failed. The lease is renewed while the work goes on, so a slow aggregation
    is never taken over; only a worker that died loses it. A failure that a retry would meet again
    (unreadable stored bytes, values the database refuses, any error but a lost connection) moves
    the round to `failed` with the reason, and the study's retry policy applies.
    """
    lease = _claim(sessions, round_id, now=now, lease_s=lease_s)
    if lease is None:
        return False
    try:
        with _lease_renewed(sessions, round_id, lease, lease_s):
            return _aggregate(sessions, round_id, lease, now=now, started=time.perf_counter())
    except (OperationalError, InterfaceError, OSError):
        raise  # the database or disk may come back: the lease runs out and another attempt takes over
    except Exception as exc:
        log.exception("round %s: aggregation failed", round_id)
        unreadable = isinstance(exc, StoredBlobError | PayloadError)
        reason = (
            f"stored update unreadable: {exc}" if unreadable else f"aggregation failed: {type(exc).__name__}: {exc}"
        )
        _fail_aggregation(sessions, round_id, lease, now=now, reason=reason)
        return False
    finally:
        release_free_heap()  # the aggregation's buffers, freed, go back to the system until the next round


def _aggregate(sessions: sessionmaker[Session], round_id: int, lease: str, *, now: datetime, started: float) -> bool:
    """The round's stored updates, in site-name order, through its workflow's aggregation; then _finish."""
    with sessions() as session:
        round_ = session.get(Round, round_id)
        study = session.get(Study, round_.study_id) if round_ is not None else None
        assert round_ is not None and study is not None
        rows = session.execute(
            select(Update.id, Site.name, Update.sha256, Update.num_examples, Update.metrics, Update.base_round)
            .join(Site, Update.site_id == Site.id)
            .where(Update.round_id == round_id)
            .order_by(Site.name)
        ).all()
        session.expunge_all()  # round_ and study keep what was read; no transaction stays open meanwhile
    contributions = [Contribution(*row) for row in rows]
    result = workflow_for(study.terms).aggregate(sessions, round_, study.terms, contributions)
    return _finish(sessions, round_id, lease, result, contributions, study.terms, now=now, started=started)


@contextmanager
def _lease_renewed(sessions: sessionmaker[Session], round_id: int, lease: str, lease_s: float) -> Iterator[None]:
    """Renew the aggregation lease every third of `lease_s` while the block runs, in a thread of its own."""
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 3):
            try:
                with sessions() as session:
                    session.execute(
                        update(Round)
                        .where(
                            Round.id == round_id,
                            Round.status == RoundStatus.AGGREGATING,
                            Round.aggregation_lease == lease,
                        )
                        .values(aggregation_started_at=utc_now())
                    )
                    session.commit()
            except Exception:  # a renewal missed: the next one tries again, the lease may lapse
                log.warning("round %s: could not renew the aggregation lease", round_id, exc_info=True)

    # The thread runs in a copy of this context: its warnings carry the round's study and number (shared.logs).
    renewer = threading.Thread(
        target=contextvars.copy_context().run, args=(renew,), name=f"lease-{round_id}", daemon=True
    )
    renewer.start()
    try:
        yield
    finally:
        done.set()
        renewer.join()


def _claim(sessions: sessionmaker[Session], round_id: int, *, now: datetime, lease_s: float) -> str | None:
    lease = uuid.uuid4().hex
    expired = now - timedelta(seconds=lease_s)
    with sessions() as session:
        claimed = cast(
            "CursorResult[Any]",
            session.execute(
                update(Round)
                .where(Round.id == round_id, Round.status == RoundStatus.OPEN)
                .values(status=RoundStatus.AGGREGATING, aggregation_lease=lease, aggregation_started_at=now)
            ),
        )
        action = "round.aggregating"
        if claimed.rowcount != 1:
            claimed = cast(
                "CursorResult[Any]",
                session.execute(
                    update(Round)
                    .where(
                        Round.id == round_id,
                        Round.status == RoundStatus.AGGREGATING,
                        Round.aggregation_started_at < expired,
                    )
                    .values(aggregation_lease=lease, aggregation_started_at=now)
                ),
            )
            action = "round.aggregation_taken_over"
        if claimed.rowcount != 1:
            session.rollback()
            return None
        study_id = session.scalar(select(Round.study_id).where(Round.id == round_id))
        audit.record(session, action, actor=SYSTEM, study_id=study_id, round_id=round_id, lease=lease)
        session.commit()
    return lease


def _finish(
    sessions: sessionmaker[Session],
    round_id: int,
    lease: str,
    result: Aggregated,
    contributions: list[Contribution],
    terms: StudyTerms,
    *,
    now: datetime,
    started: float,
) -> bool:
    """Move aggregating -> completed with theta^g_t and the weights used, then open what comes next.

    After round T comes the final evaluation round; after it (no payload) the study is completed.
    `started` is the perf_counter reading when the aggregation began: its duration is recorded.
    """
    with sessions() as session:
        seconds = time.perf_counter() - started
        done = cast(
            "CursorResult[Any]",
            session.execute(
                update(Round)
                .where(Round.id == round_id, Round.status == RoundStatus.AGGREGATING, Round.aggregation_lease == lease)
                .values(status=RoundStatus.COMPLETED, closed_at=now, aggregation_seconds=seconds)
            ),
        )
        if done.rowcount != 1:
            session.rollback()
            log.info("round %s: lease %s lost before completion; result discarded", round_id, lease)
            return False
        log.info("round %s: completed with %d update(s), aggregated in %.2f s", round_id, len(contributions), seconds)
        round_ = session.get(Round, round_id)
        study = session.get(Study, round_.study_id) if round_ is not None else None
        assert round_ is not None and study is not None
        round_.pooled = _pooled(round_, result, contributions, terms)
        digest = None
        if result.payload is None or result.weights is None:
            audit.record(
                session, "round.completed", actor=SYSTEM, study_id=study.id, round_id=round_id, round=round_.number
            )
            _set_study_status(session, study, StudyStatus.COMPLETED, now=now, rounds=round_.number - 1)
        else:
            digest = _store_global_model(session, round_, study, result, contributions, terms, now=now)
            if isinstance(cache := session.info.get(DOWNLOAD_CACHE), BlobCache):
                # Held before the commit wakes the sites: the K downloads of theta^g_t read nothing back.
                cache.offer(digest, result.payload)
        session.commit()
        release_updates(session, round_ids=[round_id])  # its stored files are not needed now
        return True


def _pooled(round_: Round, result: Aggregated, contributions: list[Contribution], terms: StudyTerms) -> dict[str, Any]:
    """The round's pooled summaries, what the pooled `eval` model is, and epsilon once theta^g_t is released."""
    pooled = {
        **pooled_summaries(
            ((c.num_examples, c.metrics) for c in contributions),
            terms.model.config().n_classes,
            trained=round_.kind == RoundKind.TRAIN,
        ),
        "global_label": study_exchange(terms).global_label(),  # what the pooled `eval` model is
    }
    if result.summed_eval:  # no site sent statistics in the clear: they come from the unmasked sum
        pooled["eval"] = result.pooled_eval
    if round_.kind == RoundKind.TRAIN and terms.privacy.dp is not None:  # epsilon after releasing theta^g_t
        pooled["privacy"] = privacy_report(terms, round_.number)
    return pooled


def _store_global_model(
    session: Session,
    round_: Round,
    study: Study,
    result: Aggregated,
    contributions: list[Contribution],
    terms: StudyTerms,
    *,
    now: datetime,
) -> str:
    """Store theta^g_t and each update's weight, audit the completion, and open the next round; theta^g_t's digest."""
    assert result.payload is not None and result.weights is not None
    digest = put_blob(session, result.payload)
    session.add(GlobalModel(study_id=study.id, round_number=round_.number, round_id=round_.id, sha256=digest))
    for contribution, weight in zip(contributions, result.weights, strict=True):
        session.execute(update(Update).where(Update.id == contribution.update_id).values(weight=weight))
    audit.record(
        session,
        "round.completed",
        actor=SYSTEM,
        study_id=study.id,
        round_id=round_.id,
        digest=digest,
        round=round_.number,
        weights={c.site: w for c, w in zip(contributions, result.weights, strict=True)},
        **_buffer_bases(contributions),
    )
    if study.status == StudyStatus.RUNNING:
        open_round(
            session,
            study_id=study.id,
            terms=terms,
            number=round_.number + 1,
            attempt=1,
            base_sha256=digest,
            now=now,
        )
    return digest


def _buffer_bases(contributions: list[Contribution]) -> dict[str, Any]:
    """A buffered release's audit detail: the version each member trained from (the runner replays it)."""
    bases = {c.site: c.base_round for c in contributions if c.base_round is not None}
    return {"bases": bases} if bases else {}


def tick(sessions: sessionmaker[Session], *, now: datetime, lease_s: float) -> None:
    """Enforce deadlines and quorum on open rounds and on studies without rounds; take over vanished aggregations."""
    with sessions() as session:
        open_ids = session.scalars(
            select(Round.id)
            .join(Study, Round.study_id == Study.id)
            .where(Round.status == RoundStatus.OPEN, Study.status == StudyStatus.RUNNING)
            .order_by(Round.id)
        ).all()
        stale = session.execute(
            select(Round.id, Round.study_id, Round.number).where(
                Round.status == RoundStatus.AGGREGATING,
                Round.aggregation_started_at < now - timedelta(seconds=lease_s),
            )
        ).all()
        session.rollback()
    for round_id in open_ids:
        close_round_if_ready(sessions, round_id, now=now, lease_s=lease_s)
    for round_id, study_id, number in stale:
        with log_context(study=study_id, round=number):
            aggregate_round(sessions, round_id, now=now, lease_s=lease_s)
    settle_job_studies(sessions, now=now)
