"""A round's workflow: what a round of one kind takes from sites between opening and aggregation, and how it sums.

The round lifecycle is one for every round (opening.py: open; updates.py: accept; closing.py:
close, aggregate, finish, retry). What differs between a plain round and a secure one (SecAgg+)
is a workflow (as Flower splits DefaultWorkflow from SecAggPlusWorkflow): plain.py and secure.py
implement `RoundWorkflow`, and dispatch.py picks one from a study's terms, so no caller tests
which kind a round is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from sqlalchemy import ColumnElement
from sqlalchemy.orm import Session, sessionmaker

from coordinator.models import Round
from shared.evaluation.metrics import Summary
from shared.tensors.codec import TensorSpec
from shared.terms import StudyTerms
from shared.wire.protocol import SecureRoundInfo, UpdateMeta

__all__ = ["Aggregated", "Contribution", "RoundWorkflow", "Routed", "Step", "UploadRules"]


@dataclass(frozen=True)
class Step:
    """What closing a due round led to: its aggregation, a failure and why, or its workflow's next phase."""

    aggregate: bool = False
    failure: str | None = None
    rescuable: bool = True  # an update stored while the round fails may still lift it to quorum (plain rounds)
    moved_to: str | None = None  # the name of the phase the round moved on to (secure rounds)


class Contribution(NamedTuple):
    """One stored update of a round, as the aggregation reads it (in site-name order)."""

    update_id: int
    site: str
    sha256: str
    num_examples: int
    metrics: dict[str, Any]
    base_round: int | None = None  # buffered studies: b_k, the version the update trained from


@dataclass(frozen=True)
class Aggregated:
    """A round's aggregate: theta^g_t's bytes as pieces (None after the final evaluation) and each update's weight."""

    payload: list[memoryview] | None  # shared.tensors.codec.dump_taking: one body, stored a part at a time
    weights: list[float] | None  # in the contributions' order
    pooled_eval: Summary | None = None  # the pooled statistics, when the sites sent them only summed (secure)
    summed_eval: bool = False  # True: `pooled_eval` replaces what the per-site reports would give


class Routed(NamedTuple):
    """The round an update answering a round's task is stored in, and the version it trained from (buffered only)."""

    round: Round
    base_round: int | None


@dataclass(frozen=True)
class UploadRules:
    """What an update of a round must hold, and which of the update checks apply to it."""

    schema: dict[str, TensorSpec]  # exactly these tensors
    private: frozenset[str]  # names that must never arrive (phi_k, algorithm state)
    usage_in_clear: bool  # a learned-heads training update carries its head usage in the clear
    zero_local_heads: bool  # with per-site head splits, the heads the site keeps local must be zero
    statistics_in_clear: bool  # the site may send its counts and histograms (else they travel summed)


class RoundWorkflow(Protocol):
    """One kind of round between its opening and its aggregation."""

    def start(self, session: Session, round_: Round, terms: StudyTerms) -> None:
        """Set up a just-flushed round (the caller commits)."""

    def offerable(self, site_id: int) -> ColumnElement[bool]:
        """SQL: whether a round of this workflow may still be offered to the site (besides being open and its)."""

    def task_setup(self, terms: StudyTerms, uid: str, round_: Round, site: str) -> SecureRoundInfo | None:
        """What a task of the round tells the site of the workflow's setup, if anything."""

    def upload_rules(self, terms: StudyTerms, kind: str) -> UploadRules:
        """What an update of a round of `kind` must hold."""

    def route_upload(self, session: Session, round_: Round, terms: StudyTerms) -> Routed:
        """The round an update answering `round_`'s task joins: `round_` itself, but in a buffered study."""

    def admit_upload(self, session: Session, round_: Round, site: str) -> None:
        """Refuse an upload the workflow takes not now or not from this site, before its bytes are read."""

    def check_upload(self, session: Session, round_id: int, site: str, meta: UpdateMeta) -> None:
        """Refuse an update whose meta contradicts what the site told the workflow before (InvalidUpload)."""

    def still_accepting(self, round_: Round) -> None:
        """Refuse (with the round row locked) an upload whose phase closed while its bytes were checked."""

    def step(self, sessions: sessionmaker[Session], round_id: int, *, now: datetime) -> Step | None:
        """Close what is due in an open round: None when nothing was due (or another worker took it)."""

    def aggregate(
        self, sessions: sessionmaker[Session], round_: Round, terms: StudyTerms, contributions: list[Contribution]
    ) -> Aggregated:
        """theta^g_t (or, for the final evaluation, only the pooled statistics) from the round's stored updates."""
