"""A buffered study's workflow (FedBuff): each round is a buffer, released once M updates arrived, whoever sent them.

Every site is asked in every round (participation `all`), with the task of the open round: train from
theta^g_{t-1}. A site's update may arrive after that round was released: it then joins the buffer
open now, its change taken against the version it trained from (Update.base_round), unless it is
more than `max_staleness` versions behind (409 update_too_stale) or the study released its last
version (409 round_closed). While a buffer is being released there is no open one: an update then
waits (503 buffer_releasing, Retry-After) instead of being lost. A site has at most one update in a
buffer, and is offered the next round once its buffer is released (coordinator/rounds/tasks.py: no
task of a round holding its update).

A buffer is released at M = `buffer_size` updates (a full buffer takes no more: 503 until the next
opens), or at its deadline with at least `min_sites`;
with fewer at the deadline it fails and is retried as a synchronous round is (a new attempt from
the same version; updates still in flight join the new attempt). The release is the study's server
step over the stored updates and the versions they trained from (shared/study/server_round.py
buffered_server_round, which the in-process runner composes the same way), read a window at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session, object_session, sessionmaker

from coordinator.errors import BufferReleasing, RoundClosed, UpdateTooStale
from coordinator.models import GlobalModel, Round, RoundKind, RoundStatus, Study, StudyStatus, Update
from coordinator.rounds.plain import PlainWorkflow
from coordinator.rounds.workflow import Aggregated, Contribution, Routed
from coordinator.storage.blobs import blob_store_of
from coordinator.storage.stored_updates import add_stored_updates
from shared.algorithms.aggregation import WeightedAverage
from shared.algorithms.server import ServerAggregator
from shared.study.server_round import SiteReport, buffered_server_round
from shared.tensors.codec import dump_taking
from shared.terms import StudyTerms

__all__ = ["BufferedWorkflow", "uploadable_rounds"]


class BufferedWorkflow(PlainWorkflow):
    """Plain uploads, routed to the open buffer; released at M updates, each against its own base version."""

    def route_upload(self, session: Session, round_: Round, terms: StudyTerms) -> Routed:
        """The open buffer an update answering `round_`'s task joins, with b_k = `round_`.number - 1."""
        if round_.kind != RoundKind.TRAIN:
            return Routed(round_, None)
        base = round_.number - 1
        if round_.status == RoundStatus.OPEN:
            return Routed(round_, base)
        latest = session.scalar(
            select(Round)
            .where(Round.study_id == round_.study_id)
            .order_by(Round.number.desc(), Round.attempt.desc())
            .limit(1)
        )
        assert latest is not None and terms.buffered is not None
        if latest.status == RoundStatus.AGGREGATING:  # being released: the next buffer opens as it completes
            raise BufferReleasing(f"study {round_.study_id} is releasing version {latest.number}: send it again")
        if latest.status != RoundStatus.OPEN or latest.kind != RoundKind.TRAIN:
            raise RoundClosed(f"round {round_.id} is {round_.status} and study {round_.study_id} takes no more updates")
        lag = latest.number - 1 - base
        if lag > terms.buffered.max_staleness:
            raise UpdateTooStale(
                f"the update trained from version {base}, {lag} versions behind the open buffer's {latest.number - 1}: "
                f"this study takes updates at most {terms.buffered.max_staleness} behind (buffered.max_staleness)"
            )
        return Routed(latest, base)

    def full(self, terms: StudyTerms, kind: str, reported: int) -> bool:
        """A training buffer holding M updates is released (M >= min_sites: the terms are checked so)."""
        return kind == RoundKind.TRAIN and terms.buffered is not None and reported >= terms.buffered.buffer_size

    def still_accepting(self, round_: Round) -> None:
        """A full buffer takes no more (it is about to be released): the update waits for the next one (503)."""
        session = object_session(round_)
        study = session.get(Study, round_.study_id) if session is not None else None
        if session is None or study is None:
            return
        held = session.scalar(select(func.count()).select_from(Update).where(Update.round_id == round_.id)) or 0
        if self.full(study.terms, round_.kind, held):
            raise BufferReleasing(f"round {round_.id} holds its {held} updates and is being released: send it again")

    def aggregate(
        self, sessions: sessionmaker[Session], round_: Round, terms: StudyTerms, contributions: list[Contribution]
    ) -> Aggregated:
        """theta^g_t from theta^g_{t-1}, the buffer's stored updates and each base version they trained from."""
        if round_.kind == RoundKind.EVALUATE:
            return Aggregated(None, None)
        current = round_.number - 1
        bases = [current if c.base_round is None else c.base_round for c in contributions]
        with sessions() as session:
            engine, store = session.get_bind().engine, blob_store_of(session)
            versions = dict(
                session.execute(
                    select(GlobalModel.round_number, GlobalModel.sha256).where(
                        GlobalModel.study_id == round_.study_id, GlobalModel.round_number.in_(set(bases))
                    )
                ).all()
            )
            session.rollback()
        digests = [c.sha256 for c in contributions]
        reports = [SiteReport(c.site, c.num_examples, c.metrics) for c in contributions]

        def add_previous(average: WeightedAverage) -> None:
            add_stored_updates(average, engine, [round_.base_sha256], [1.0], store=store)

        def add_base(average: WeightedAverage, base: int, weight: float) -> None:
            add_stored_updates(average, engine, [versions[base]], [weight], store=store)

        def add_updates(aggregator: ServerAggregator, weights: Sequence[float]) -> None:
            add_stored_updates(aggregator, engine, digests, list(weights), store=store)  # a window at a time

        theta, weights = buffered_server_round(terms, reports, bases, current, add_previous, add_base, add_updates)
        meta = {"study": str(round_.study_id), "round": str(round_.number), "part": "global"}
        return Aggregated([dump_taking(theta, meta)], weights)


def uploadable_rounds(session: Session) -> set[int]:
    """The rounds an update may still be sent to: every open one, and a running buffered study's released ones."""
    found = set(session.scalars(select(Round.id).where(Round.status == RoundStatus.OPEN)))
    running = session.execute(select(Study.id, Study.terms).where(Study.status == StudyStatus.RUNNING)).all()
    buffered = [study_id for study_id, terms in running if terms.buffered is not None]
    if buffered:
        found.update(
            session.scalars(
                select(Round.id).where(
                    Round.study_id.in_(buffered), Round.kind == RoundKind.TRAIN, Round.status != RoundStatus.CANCELLED
                )
            )
        )
    return found
