"""A plain round's workflow: sites upload their shared tensors in the clear, the server averages the stored updates.

A plain round closes when every selected site has reported or declined, or at its deadline; with
at least `min_sites` updates it is aggregated, else it fails (and is retried by the lifecycle).
Aggregation reads the stored updates one window at a time into the study's server step
(shared/study/server_round.py, which the in-process runner composes the same way): memory stays a few
models whatever the number of sites.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from coordinator.models import Round, RoundKind, Study, Update
from coordinator.rounds.declines import silent_declines
from coordinator.rounds.upload_schema import exchange_schema
from coordinator.rounds.workflow import Aggregated, Contribution, Routed, Step, UploadRules
from coordinator.storage.blobs import blob_store_of
from coordinator.storage.stored_updates import add_stored_updates, stored_headers
from coordinator.storage.update_files import BlobStore
from shared.algorithms.aggregation import WeightedAverage
from shared.algorithms.server import ServerAggregator
from shared.study.rules import algorithm_model
from shared.study.server_round import SiteReport, server_round
from shared.tensors.codec import dump_taking
from shared.terms import StudyTerms
from shared.wire.protocol import SecureRoundInfo, UpdateMeta

__all__ = ["QUORUM_MISSED", "PlainWorkflow"]

QUORUM_MISSED = "quorum missed"  # how a round that too few sites reported to fails: its note begins so


class PlainWorkflow:
    """Updates in the clear, checked against the study's schema, averaged from the blob store."""

    def start(self, session: Session, round_: Round, terms: StudyTerms) -> None:
        """Nothing to set up: the round takes updates from its opening."""

    def offerable(self, site_id: int) -> ColumnElement[bool]:
        """Every open plain round of the site's."""
        return Round.secagg_phase.is_(None)

    def task_setup(self, terms: StudyTerms, uid: str, round_: Round, site: str) -> SecureRoundInfo | None:
        """A plain task carries no setup of its own."""
        return None

    def upload_rules(self, terms: StudyTerms, kind: str) -> UploadRules:
        """The study's shared schema (none in the final evaluation), the usages and local heads checked in the clear."""
        schema, private = exchange_schema(terms)
        trains = kind == RoundKind.TRAIN
        return UploadRules(
            schema=schema if trains else {},
            private=private,
            usage_in_clear=trains,
            zero_local_heads=trains and bool(terms.model.site_heads),
            statistics_in_clear=True,
        )

    def route_upload(self, session: Session, round_: Round, terms: StudyTerms) -> Routed:
        """An update joins the round whose task it answers."""
        return Routed(round_, None)

    def admit_upload(self, session: Session, round_: Round, site: str) -> None:
        """Any selected site uploads while the round is open."""

    def check_upload(self, session: Session, round_id: int, site: str, meta: UpdateMeta) -> None:
        """Nothing told before to contradict."""

    def still_accepting(self, round_: Round) -> None:
        """An open plain round takes updates until it closes."""

    def full(self, terms: StudyTerms, kind: str, reported: int) -> bool:
        """Whether the round holds all it may take before every selected site settled: never, for a plain round."""
        return False

    def step(self, sessions: sessionmaker[Session], round_id: int, *, now: datetime) -> Step | None:
        """Aggregate with quorum once every selected site reported or declined, or at the deadline; else fail then."""
        with sessions() as session:
            round_ = session.get(Round, round_id)
            assert round_ is not None
            reported = session.scalar(select(func.count()).select_from(Update).where(Update.round_id == round_id)) or 0
            declined = silent_declines(session, round_id)
            selected, past_deadline = len(round_.participants), now >= round_.deadline_at
            study = session.get(Study, round_.study_id)
            assert study is not None
            min_sites, full = study.terms.min_sites, self.full(study.terms, round_.kind, reported)
            session.rollback()
        settled = reported + declined >= selected  # every selected site reported or declined: no update is to come
        if reported >= min_sites and (settled or past_deadline or full):
            return Step(aggregate=True)
        if settled or past_deadline:
            declines = f", {declined} declined" if declined else ""
            return Step(failure=f"{QUORUM_MISSED}: {reported} of {selected} updates{declines}, min_sites {min_sites}")
        return None

    def aggregate(
        self, sessions: sessionmaker[Session], round_: Round, terms: StudyTerms, contributions: list[Contribution]
    ) -> Aggregated:
        """The weights, the stored updates summed a window at a time, the algorithm's server step: theta^g_t."""
        if round_.kind == RoundKind.EVALUATE:  # sites only reported statistics of theta^g_T
            return Aggregated(None, None)
        with sessions() as session:
            engine, store = session.get_bind().engine, blob_store_of(session)
            session.rollback()
        digests = [c.sha256 for c in contributions]
        metas = _learned_heads_metas(terms, engine, store, digests)
        reports = [
            SiteReport(c.site, c.num_examples, c.metrics, metas[index] if metas else None)
            for index, c in enumerate(contributions)
        ]

        def previous(average: WeightedAverage) -> None:
            add_stored_updates(average, engine, [round_.base_sha256], [1.0], store=store)

        def updates(aggregator: ServerAggregator, weights: Sequence[float]) -> None:
            add_stored_updates(aggregator, engine, digests, list(weights), store=store)  # a window at a time

        theta, weights = server_round(terms, reports, previous, updates)
        meta = {"study": str(round_.study_id), "round": str(round_.number), "part": "global"}
        return Aggregated([dump_taking(theta, meta)], weights)


def _learned_heads_metas(
    terms: StudyTerms, engine: Engine, store: BlobStore | None, digests: Sequence[str]
) -> list[UpdateMeta]:
    """The stored updates' metas when the study learns its heads (their usages weigh each head), else none."""
    if not algorithm_model(terms.model, terms.algorithm).learned_heads:
        return []
    return [UpdateMeta.from_metadata(header.metadata) for header in stored_headers(engine, digests, store)]
