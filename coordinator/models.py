"""The coordinator's tables: sites, tokens, studies, rounds, updates, secure-round messages, models, blobs, audit."""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import DDL, JSON, BigInteger, Float, ForeignKey, Integer, LargeBinary, String, UniqueConstraint, event
from sqlalchemy.orm import Mapped, mapped_column

from coordinator.db import Base, TermsColumn, UTCDateTime, utc_now
from shared.terms import StudyTerms
from shared.wire.protocol import RoundKind  # the one enum of both sides; re-exported for the rooms above

__all__ = [
    "AuditEvent",
    "Blob",
    "BlobPart",
    "GlobalModel",
    "Role",
    "Round",
    "RoundKind",
    "RoundStatus",
    "SecAggMessage",
    "Site",
    "SiteApproval",
    "SiteReport",
    "Study",
    "StudyStatus",
    "TaskDecline",
    "Token",
    "Update",
    "WorkVersion",
    "new_study_uid",
]


class Role(StrEnum):
    """What a token may do (docs/architecture/protocol.md)."""

    ADMIN = "admin"  # enrol sites, manage tokens, and everything a researcher may do
    RESEARCHER = "researcher"  # create and run studies, read results, download models
    SITE = "site"  # its own tasks and uploads only
    VIEWER = "viewer"  # read-only: studies, rounds, status


class StudyStatus(StrEnum):
    """Life of a study: draft -> running <-> paused -> completed, or failed / cancelled."""

    DRAFT = "draft"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RoundStatus(StrEnum):
    """Life of a round attempt: open -> aggregating -> completed, or failed (quorum missed) / cancelled."""

    OPEN = "open"
    AGGREGATING = "aggregating"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class BlobLocation(StrEnum):
    """Where a blob's bytes are."""

    DATABASE = "database"  # in BlobPart rows (global models, phi_0; updates when no blob store is configured)
    STORE = "store"  # in the blob store, a file named by its sha256 (coordinator.storage.update_files)
    RELEASED = "released"  # an update's file, removed after its round by the retention rule


class Blob(Base):
    """Content-addressed bytes (safetensors): uploads, global models, phi_0; in the database, as BlobPart rows."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex digest of the bytes
    size: Mapped[int] = mapped_column(BigInteger)  # length of the bytes
    location: Mapped[str] = mapped_column(  # a BlobLocation value
        String(16), default=BlobLocation.DATABASE, server_default=BlobLocation.DATABASE.value
    )
    checksums: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)  # a stored file's block checksums
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)


class BlobPart(Base):
    """One part of a blob kept in the database: its bytes from part `seq`'s offset, parts in order, each at most 64 MiB.

    A database value has a ceiling (SQLite 1,000,000,000 bytes; a PostgreSQL bytea 1 GiB), and one
    value is written and read whole by the drivers; parts keep a model of any size storable and
    let it stream in and out a part at a time (coordinator/storage/blob_parts.py).
    """

    __tablename__ = "blob_parts"

    sha256: Mapped[str] = mapped_column(String(64), ForeignKey("blobs.sha256", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0, 1, ...: the parts' order
    data: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)


class Site(Base):
    """An enrolled hospital; its agent authenticates with a site token."""

    __tablename__ = "sites"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    last_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # last authenticated request
    # The site's long-term Ed25519 public key (hex), registered by its agent at its first start; a
    # secure study's terms name it (privacy.secure_aggregation.site_keys), so its sites approve it.
    signing_key: Mapped[str | None] = mapped_column(String(64))


class Token(Base):
    """An API token; only the sha256 of the secret is kept, the secret is shown once."""

    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    role: Mapped[str] = mapped_column(String(16))  # a Role value
    site_id: Mapped[int | None] = mapped_column(ForeignKey("sites.id"))  # set for role "site" only
    label: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # refused from this instant on


def new_study_uid() -> str:
    """A random 128-bit study identity, as 32 hex digits."""
    return uuid.uuid4().hex


class Study(Base):
    """A federated training job; its `terms` (shared.terms.StudyTerms), fixed at creation, are all it runs by."""

    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Unique across databases: sites key their local state by it, so a study 1 of a new database
    # never meets what a site kept for the study 1 of another.
    uid: Mapped[str] = mapped_column(String(32), unique=True, index=True, default=new_study_uid)
    name: Mapped[str] = mapped_column(String(200))
    terms: Mapped[StudyTerms] = mapped_column(TermsColumn)
    status: Mapped[str] = mapped_column(String(16), default=StudyStatus.DRAFT)  # a StudyStatus value
    created_by: Mapped[str] = mapped_column(String(100))  # actor that created it
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)


class Round(Base):
    """One attempt at communication round `number` of a study; a retried round gets a new attempt."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("study_id", "number", "attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)  # t, from 1
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    kind: Mapped[str] = mapped_column(String(16), default=RoundKind.TRAIN, server_default=RoundKind.TRAIN.value)
    status: Mapped[str] = mapped_column(String(16), index=True)  # a RoundStatus value
    participants: Mapped[dict[str, float]] = mapped_column(JSON)  # selected site name -> load factor
    base_sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))  # theta^g_{t-1} sites train from
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    deadline_at: Mapped[datetime] = mapped_column(UTCDateTime)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # completed, failed or cancelled
    aggregation_lease: Mapped[str | None] = mapped_column(String(36))  # id of the worker aggregating it
    aggregation_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # claimed; renewed while it runs
    aggregation_seconds: Mapped[float | None] = mapped_column(Float)  # how long its aggregation took, once completed
    note: Mapped[str] = mapped_column(String(500), default="")  # why it failed or was cancelled
    pooled: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # summaries of the summed EvalStats, once completed
    # Secure rounds only (coordinator/rounds/secure.py): the SecAgg+ phase 0..3 while open, its deadline, and
    # the round's public setup, then the weights fixed when phase 0 closed and the unmask request of phase 3.
    secagg_phase: Mapped[int | None] = mapped_column(Integer)
    secagg_deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    secagg_state: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Update(Base):
    """Site k's upload for a round attempt: shared tensors (a blob), n_k and metrics."""

    __tablename__ = "updates"
    __table_args__ = (UniqueConstraint("round_id", "site_id"),)  # one update per site per round

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"))
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id"))
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))  # the uploaded safetensors bytes
    size: Mapped[int] = mapped_column(BigInteger)
    num_examples: Mapped[int] = mapped_column(BigInteger)  # n_k
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, deferred=True)  # shared.wire.protocol.UpdateMetrics as JSON
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)  # EvalStats summaries: {"eval": ..., "local_eval": ...}
    train_seconds: Mapped[float] = mapped_column(Float)
    weight: Mapped[float | None] = mapped_column(Float)  # aggregation weight w_k, set when the round completes
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    # Buffered studies only (coordinator/rounds/buffered.py): the round attempt whose task the update answers,
    # which may have closed since (the update then joins the open buffer), and b_k, the version it trained from.
    task_round_id: Mapped[int | None] = mapped_column(ForeignKey("rounds.id"))
    base_round: Mapped[int | None] = mapped_column(Integer)


class SecAggMessage(Base):
    """One site's message of one phase of a secure round: keys and scalars (0), sealed shares (1), reveals (3).

    Phase 2's masked vector is an Update whose blob holds it; no message here ever holds an unmasked update.
    """

    __tablename__ = "secagg_messages"
    __table_args__ = (UniqueConstraint("round_id", "site_id", "phase"),)  # one message per site per phase

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id"))
    phase: Mapped[int] = mapped_column(Integer)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the validated message (shared.wire.secure) as JSON
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)


class TaskDecline(Base):
    """A site declined its task of a round attempt, and why: its round goes on (docs/architecture/protocol.md).

    A site declines a task that disagrees with the terms its operator approved; the coordinator
    offers it that round attempt no more and settles the round without its update.
    """

    __tablename__ = "task_declines"
    __table_args__ = (UniqueConstraint("round_id", "site_id"),)  # one decline per site per round attempt

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id"))
    reason: Mapped[str] = mapped_column(String(2000))
    declined_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)


class GlobalModel(Base):
    """theta^g_t of a study after round t (t = 0: the seeded initial model, with phi_0 beside it)."""

    __tablename__ = "global_models"
    __table_args__ = (UniqueConstraint("study_id", "round_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"))
    round_number: Mapped[int] = mapped_column(Integer)  # t
    round_id: Mapped[int | None] = mapped_column(ForeignKey("rounds.id"))  # the attempt that made it; none for t = 0
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))  # theta^g_t
    local_sha256: Mapped[str | None] = mapped_column(ForeignKey("blobs.sha256"))  # phi_0, round 0 only
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)


class SiteApproval(Base):
    """What a site last reported of a study that lists it: approved by its operator, or awaiting approval.

    The site decides, from a digest it computes itself; the coordinator only mirrors the report, so
    that it offers tasks to approved sites alone and can show who is waiting for whom.
    """

    __tablename__ = "site_approvals"
    __table_args__ = (UniqueConstraint("study_id", "site_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id"))
    state: Mapped[str] = mapped_column(String(24))  # a shared.wire.protocol.ApprovalState value
    digest: Mapped[str] = mapped_column(String(64))  # the study description's digest the site computed
    reported_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)


class SiteReport(Base):
    """A site's report of a job outside rounds (shared/wire/jobs.py): a survey, an external validation, an evaluation.

    `body` is the validated JobReport as JSON; one per site, kind and evaluated round (0 but for external).
    """

    __tablename__ = "site_reports"
    __table_args__ = (UniqueConstraint("study_id", "site_id", "kind", "round_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"), index=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id"))
    kind: Mapped[str] = mapped_column(String(16))  # a shared.wire.jobs.JobKind value
    round_number: Mapped[int] = mapped_column(Integer)  # external: t of the evaluated theta^g_t; else 0
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)


class WorkVersion(Base):
    """One row whose number rises with every commit that may have given a site work (coordinator/signals/work.py).

    Every coordinator process reads it once per poll interval and wakes its waiting polls when it
    moved: K waiting polls cost one query per interval and process, not K.
    """

    __tablename__ = "work_versions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


# DDL's __init__ has no annotations in SQLAlchemy 2.
_SEED_WORK_VERSION = DDL("INSERT INTO work_versions (id, version) VALUES (1, 0)")  # type: ignore[no-untyped-call]
event.listen(WorkVersion.__table__, "after_create", _SEED_WORK_VERSION)


class AuditEvent(Base):
    """Who did what, when, to which study/round/site, with which digest; written with every state change."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    actor: Mapped[str] = mapped_column(String(100))  # "admin:env", "token:3", "site:lyon", "system"
    action: Mapped[str] = mapped_column(String(64), index=True)  # e.g. "round.opened", "update.refused"
    study_id: Mapped[int | None] = mapped_column(Integer, index=True)
    round_id: Mapped[int | None] = mapped_column(Integer)
    site_id: Mapped[int | None] = mapped_column(Integer)
    digest: Mapped[str | None] = mapped_column(String(64))  # sha256 of the blob involved
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
