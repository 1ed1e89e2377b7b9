"""The round engine: open -> aggregating -> completed, or failed / cancelled, safe with many workers.

Every transition is a conditional UPDATE on `rounds.status` (and, while aggregating, on the
worker's lease), so exactly one worker wins it. Aggregation reads the stored updates one at a
time into the study algorithm's server update (shared.study.server_aggregator: a weighted average,
or Scaffold's step, which also reads theta^g_{t-1}): memory stays a few models whatever the number
of sites. Participation policies that drop slow sites get each site's last measured round time.
A worker killed mid-aggregation leaves the round `aggregating`; once its lease expires another
worker recomputes it from the same stored updates, so nothing is lost or counted twice.
A round of a secure study walks its SecAgg+ phases while open (coordinator/secure_rounds.py) and
is aggregated from the unmasked sum of its stored masked vectors.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from coordinator import audit, secure_rounds
from coordinator.blob_store import BlobStore, StoredBlobError
from coordinator.blobs import put_blob
from coordinator.db import blob_store_of, utc_now
from coordinator.declines import silent_declines
from coordinator.models import GlobalModel, Round, RoundKind, RoundStatus, Site, Study, StudyStatus, Update
from coordinator.retention import release_updates
from coordinator.stored_updates import add_stored_updates, stored_headers
from shared.algorithms.server import ServerAggregator, global_from_sums
from shared.algorithms.weightings import aggregation_weights
from shared.evaluation import pooled_summaries
from shared.privacy.study_dp import privacy_report, trained_rounds
from shared.privacy.study_secagg import SecureSumDecoded
from shared.study import algorithm_model, select_participants, server_aggregator, study_exchange
from shared.tensors import PayloadError, dump
from shared.terms import StudyTerms
from shared.wire.protocol import UpdateMeta

__all__ = ["aggregate_round", "close_round_if_ready", "kind_of", "last_round_seconds", "open_round", "tick"]

log = logging.getLogger(__name__)
SYSTEM = "system"


def kind_of(config: StudyTerms, number: int) -> RoundKind:
    """Rounds 1..T train; round T+1 is the final evaluation of theta^g_T (T: fewer when an epsilon budget says so)."""
    return RoundKind.EVALUATE if number > trained_rounds(config.privacy.dp, config.rounds) else RoundKind.TRAIN


def open_round(
    session: Session,
    *,
    study_id: int,
    config: StudyTerms,
    number: int,
    attempt: int,
    base_sha256: str,
    now: datetime,
    actor: str = SYSTEM,
) -> Round:
    """Add round `number` (attempt `attempt`) with the participants the study's policy picks; caller commits.

    The final evaluation round asks every site, with no load factor: it only evaluates theta^g_T.
    """
    kind = kind_of(config, number)
    if kind is RoundKind.EVALUATE:
        participants = dict.fromkeys(config.sites, 1.0)
    else:
        participants = select_participants(config, number, attempt, lambda: last_round_seconds(session, study_id))
    round_ = Round(
        study_id=study_id,
        number=number,
        attempt=attempt,
        kind=kind,
        status=RoundStatus.OPEN,
        participants=participants,
        base_sha256=base_sha256,
        opened_at=now,
        deadline_at=now + timedelta(seconds=config.round_deadline_s),
    )
    session.add(round_)
    session.flush()
    if config.privacy.secure_aggregation is not None:
        secure_rounds.start(session, round_, config)
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


def close_round_if_ready(
    sessions: sessionmaker[Session], round_id: int, *, now: datetime, lease_s: float
) -> RoundStatus | None:
    """Aggregate with quorum once every participant reported or declined, or at the deadline; else fail then.

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
        if round_.secagg_phase is not None:
            session.rollback()
            return _close_secure_round(sessions, round_id, now=now, lease_s=lease_s)
        config = study.terms
        reported = session.scalar(select(func.count()).select_from(Update).where(Update.round_id == round_id)) or 0
        declined = silent_declines(session, round_id)
        selected = len(round_.participants)
        past_deadline = now >= round_.deadline_at
        session.rollback()
    settled = reported + declined >= selected  # every selected site reported or declined: no update is to come
    if reported >= config.min_sites and (settled or past_deadline):
        return RoundStatus.COMPLETED if aggregate_round(sessions, round_id, now=now, lease_s=lease_s) else None
    if settled or past_deadline:
        declines = f", {declined} declined" if declined else ""
        reason = f"quorum missed: {reported} of {selected} updates{declines}, min_sites {config.min_sites}"
        return RoundStatus.FAILED if _fail_round(sessions, round_id, now=now, reason=reason) else None
    return None


def _close_secure_round(
    sessions: sessionmaker[Session], round_id: int, *, now: datetime, lease_s: float
) -> RoundStatus | None:
    """Move a secure round to its next phase when due; after the last, aggregate; below quorum, fail it."""
    step = secure_rounds.advance(sessions, round_id, now=now)
    if step is not None and step.aggregate:
        return RoundStatus.COMPLETED if aggregate_round(sessions, round_id, now=now, lease_s=lease_s) else None
    if step is not None and step.failure is not None:
        failed = _fail_round(sessions, round_id, now=now, reason=step.failure, quorum_rescues=False)
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
        config = study.terms
        reported = session.scalar(select(func.count()).select_from(Update).where(Update.round_id == round_id)) or 0
        if quorum_rescues and reported >= config.min_sites:  # an update arrived meanwhile: the next check aggregates
            session.rollback()
            return False
        failed = session.execute(
            update(Round)
            .where(Round.id == round_id, Round.status == RoundStatus.OPEN)
            .values(status=RoundStatus.FAILED, closed_at=now, note=reason)
        )
        if failed.rowcount != 1:
            session.rollback()
            return False
        session.refresh(round_)
        _after_failure(session, round_, study, config, reason=reason, now=now)
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
        failed = session.execute(
            update(Round)
            .where(Round.id == round_id, Round.status == RoundStatus.AGGREGATING, Round.aggregation_lease == lease)
            .values(status=RoundStatus.FAILED, closed_at=now, note=reason[:500])
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
    session: Session, round_: Round, study: Study, config: StudyTerms, *, reason: str, now: datetime
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
    elif round_.attempt <= config.round_retries:
        open_round(
            session,
            study_id=study.id,
            config=config,
            number=round_.number,
            attempt=round_.attempt + 1,
            base_sha256=round_.base_sha256,
            now=now,
        )
    else:
        _set_study_status(session, study, StudyStatus.FAILED, reason=f"round {round_.number}: {reason}", now=now)


def _set_study_status(session: Session, study: Study, status: StudyStatus, *, now: datetime, **detail: object) -> None:
    study.status = status
    study.updated_at = now
    audit.record(session, f"study.{status.value}", actor=SYSTEM, study_id=study.id, **detail)


class _Contribution(NamedTuple):
    update_id: int
    site: str
    sha256: str
    num_examples: int
    metrics: dict


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


def _aggregate(sessions: sessionmaker[Session], round_id: int, lease: str, *, now: datetime, started: float) -> bool:
    """Weights, the stored updates summed a window at a time, the algorithm's server step, then _finish."""
    with sessions() as session:
        round_ = session.get(Round, round_id)
        study = session.get(Study, round_.study_id) if round_ is not None else None
        assert round_ is not None and study is not None
        config = study.terms
        rows = session.execute(
            select(Update.id, Site.name, Update.sha256, Update.num_examples, Update.metrics)
            .join(Site, Update.site_id == Site.id)
            .where(Update.round_id == round_id)
            .order_by(Site.name)
        ).all()
        contributions = [_Contribution(*row) for row in rows]
        number, study_id, kind, base_sha256 = round_.number, study.id, round_.kind, round_.base_sha256
        secure_phase = round_.secagg_phase
        engine = session.get_bind().engine  # the updates are read outside this session (see open_blobs)
        store = blob_store_of(session)
    if secure_phase is not None:
        return _aggregate_secure(sessions, round_id, lease, contributions, config, now=now, started=started)
    if kind == RoundKind.EVALUATE:  # sites only reported statistics of theta^g_T
        return _finish(sessions, round_id, lease, None, contributions, None, config, now=now, started=started)
    weights = aggregation_weights(
        [c.num_examples for c in contributions],
        config.aggregation.name,
        config.aggregation.params,
        metrics=[c.metrics for c in contributions],
    )
    metas = _learned_heads_metas(config, engine, store, [c.sha256 for c in contributions])
    aggregator = _server_step(config, engine, store, base_sha256, [c.site for c in contributions], metas)
    # read a window at a time: no update is ever whole in memory
    add_stored_updates(aggregator, engine, [c.sha256 for c in contributions], weights, store=store)
    payload = dump(aggregator.result(), {"study": str(study_id), "round": str(number), "part": "global"})
    return _finish(sessions, round_id, lease, payload, contributions, weights, config, now=now, started=started)


def _learned_heads_metas(
    config: StudyTerms, engine: Engine, store: BlobStore | None, digests: Sequence[str]
) -> list[UpdateMeta]:
    """The stored updates' metas when the study learns its heads (their usages weigh each head), else none."""
    if not algorithm_model(config.model, config.algorithm).learned_heads:
        return []
    return [UpdateMeta.from_metadata(header.metadata) for header in stored_headers(engine, digests, store)]


def _server_step(
    config: StudyTerms,
    engine: Engine,
    store: BlobStore | None,
    base_sha256: str,
    sites: Sequence[str] = (),
    metas: Sequence[UpdateMeta] = (),
) -> ServerAggregator:
    """The algorithm's server update (a weighted average, Scaffold's ...), with theta^g_{t-1} when it reads it.

    `sites` are the updates' sites in the order they are added (per-site head splits weigh heads by
    them); `metas` their metas (learned heads weigh heads by the usages uploaded in them).
    """
    aggregator = server_aggregator(config, sites, metas)
    if aggregator.previous is not None:  # it also reads theta^g_{t-1} with the server state stored beside it
        add_stored_updates(aggregator.previous, engine, [base_sha256], [1.0], store=store)
    return aggregator


def _aggregate_secure(
    sessions: sessionmaker[Session],
    round_id: int,
    lease: str,
    contributions: list[_Contribution],
    config: StudyTerms,
    *,
    now: datetime,
    started: float,
) -> bool:
    """The survivors' masked vectors summed and unmasked, the server step on their sums as theta^g_t (or statistics)."""
    with sessions() as session:
        round_ = session.get(Round, round_id)
        assert round_ is not None
        number, study_id, kind, base_sha256 = round_.number, round_.study_id, round_.kind, round_.base_sha256
        engine, store = session.get_bind().engine, blob_store_of(session)
        session.rollback()
    decoded, weights = secure_rounds.unmasked_sums(sessions, engine, store, round_id, config)
    if kind == RoundKind.EVALUATE:
        return _finish(
            sessions, round_id, lease, None, contributions, None, config, now=now, started=started, secure=decoded
        )
    aggregator = _server_step(config, engine, store, base_sha256)
    theta = global_from_sums(aggregator, None, decoded.schema, decoded.sums, decoded.weight_sum, decoded.survivors)
    payload = dump(theta, {"study": str(study_id), "round": str(number), "part": "global"})
    used = [weights[c.site] for c in contributions]
    return _finish(
        sessions, round_id, lease, payload, contributions, used, config, now=now, started=started, secure=decoded
    )


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

    renewer = threading.Thread(target=renew, name=f"lease-{round_id}", daemon=True)
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
        claimed = session.execute(
            update(Round)
            .where(Round.id == round_id, Round.status == RoundStatus.OPEN)
            .values(status=RoundStatus.AGGREGATING, aggregation_lease=lease, aggregation_started_at=now)
        )
        action = "round.aggregating"
        if claimed.rowcount != 1:
            claimed = session.execute(
                update(Round)
                .where(
                    Round.id == round_id,
                    Round.status == RoundStatus.AGGREGATING,
                    Round.aggregation_started_at < expired,
                )
                .values(aggregation_lease=lease, aggregation_started_at=now)
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
    payload: bytes | None,
    contributions: list[_Contribution],
    weights: list[float] | None,
    config: StudyTerms,
    *,
    now: datetime,
    started: float,
    secure: SecureSumDecoded | None = None,
) -> bool:
    """Move aggregating -> completed with theta^g_t and the weights used, then open what comes next.

    After round T comes the final evaluation round; after it (payload None) the study is completed.
    `started` is the perf_counter reading when the aggregation began: its duration is recorded.
    """
    with sessions() as session:
        seconds = time.perf_counter() - started
        done = session.execute(
            update(Round)
            .where(Round.id == round_id, Round.status == RoundStatus.AGGREGATING, Round.aggregation_lease == lease)
            .values(status=RoundStatus.COMPLETED, closed_at=now, aggregation_seconds=seconds)
        )
        if done.rowcount != 1:
            session.rollback()
            log.info("round %s: lease %s lost before completion; result discarded", round_id, lease)
            return False
        log.info("round %s: completed with %d update(s), aggregated in %.2f s", round_id, len(contributions), seconds)
        round_ = session.get(Round, round_id)
        study = session.get(Study, round_.study_id) if round_ is not None else None
        assert round_ is not None and study is not None
        round_.pooled = {
            **pooled_summaries(
                ((c.num_examples, c.metrics) for c in contributions),
                config.model.config().n_classes,
                trained=round_.kind == RoundKind.TRAIN,
            ),
            "global_label": study_exchange(config).global_label(),  # what the pooled `eval` model is
        }
        if secure is not None:  # no site sent statistics in the clear: they come from the unmasked sum
            round_.pooled["eval"] = secure.pooled_eval
        if round_.kind == RoundKind.TRAIN and config.privacy.dp is not None:  # epsilon after releasing theta^g_t
            round_.pooled["privacy"] = privacy_report(config.privacy.dp, round_.number)
        if payload is None or weights is None:
            audit.record(
                session,
                "round.completed",
                actor=SYSTEM,
                study_id=study.id,
                round_id=round_id,
                round=round_.number,
                kind=round_.kind,
            )
            _set_study_status(session, study, StudyStatus.COMPLETED, now=now, rounds=round_.number - 1)
            session.commit()
            release_updates(session, round_ids=[round_id])  # its stored files are not needed now
            return True
        digest = put_blob(session, payload)
        session.add(GlobalModel(study_id=study.id, round_number=round_.number, round_id=round_id, sha256=digest))
        for contribution, weight in zip(contributions, weights, strict=True):
            session.execute(update(Update).where(Update.id == contribution.update_id).values(weight=weight))
        audit.record(
            session,
            "round.completed",
            actor=SYSTEM,
            study_id=study.id,
            round_id=round_id,
            digest=digest,
            round=round_.number,
            weights={c.site: w for c, w in zip(contributions, weights, strict=True)},
        )
        if study.status == StudyStatus.RUNNING:
            open_round(
                session,
                study_id=study.id,
                config=config,
                number=round_.number + 1,
                attempt=1,
                base_sha256=digest,
                now=now,
            )
        session.commit()
        release_updates(session, round_ids=[round_id])  # its stored files are not needed now
        return True


def tick(sessions: sessionmaker[Session], *, now: datetime, lease_s: float) -> None:
    """Enforce deadlines and quorum on open rounds, and take over aggregations whose worker vanished."""
    with sessions() as session:
        open_ids = session.scalars(
            select(Round.id)
            .join(Study, Round.study_id == Study.id)
            .where(Round.status == RoundStatus.OPEN, Study.status == StudyStatus.RUNNING)
            .order_by(Round.id)
        ).all()
        stale_ids = session.scalars(
            select(Round.id).where(
                Round.status == RoundStatus.AGGREGATING,
                Round.aggregation_started_at < now - timedelta(seconds=lease_s),
            )
        ).all()
        session.rollback()
    for round_id in open_ids:
        close_round_if_ready(sessions, round_id, now=now, lease_s=lease_s)
    for round_id in stale_ids:
        aggregate_round(sessions, round_id, now=now, lease_s=lease_s)
