"""JSON bodies of the coordinator's own endpoints (the site protocol's models live in shared/wire/protocol.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, StringConstraints

from shared.terms import SiteName, StudyTerms
from shared.wire.metrics import MetricSummary, PooledMetrics, PrivacySpent

# Text that people type: printable, no NUL or other control characters (PostgreSQL's text holds no NUL).
Label = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]*$", max_length=200)]

__all__ = [
    "AuditEventPublic",
    "GlobalModelPublic",
    "HealthReport",
    "MetricSummary",
    "ModelUploaded",
    "Page",
    "PooledMetrics",
    "PrivacySpent",
    "RoundPublic",
    "SiteCreate",
    "SiteEnrolled",
    "SitePublic",
    "SigningKey",
    "SiteStatus",
    "StatusReport",
    "StudyCreate",
    "StudyPublic",
    "StudyStatusLine",
    "TokenCreate",
    "TokenIssued",
    "TokenPublic",
    "TransferProgress",
    "UpdatePublic",
]

T = TypeVar("T")


class _Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(BaseModel, Generic[T]):
    """A list response: the items and how many there are."""

    data: list[T]
    count: int


# Admin: sites and tokens


class SiteCreate(BaseModel):
    """Enrol a site under a unique name."""

    model_config = ConfigDict(extra="forbid")
    name: SiteName


class SitePublic(_Public):
    """An enrolled site."""

    id: int
    name: str
    created_at: datetime
    last_seen_at: datetime | None
    signing_key: str | None = None  # its long-term Ed25519 public key (hex), once its agent registered it


class SigningKey(BaseModel):
    """A site's long-term Ed25519 public key, as its agent registers it."""

    model_config = ConfigDict(extra="forbid")
    public_key: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class TokenCreate(BaseModel):
    """Issue a token for a person (site tokens come from enrolment or rotation)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["admin", "researcher", "viewer"]
    label: Label = ""


class TokenPublic(_Public):
    """A token as listed: never its secret."""

    id: int
    role: str
    label: str
    site: str | None = None
    created_at: datetime
    revoked_at: datetime | None


class TokenIssued(BaseModel):
    """A new token; `token` is shown this once and cannot be recovered."""

    id: int
    role: str
    site: str | None = None
    token: str


class SiteEnrolled(BaseModel):
    """A newly enrolled site and its first token (shown once)."""

    site: SitePublic
    token: TokenIssued


# Researcher: studies, rounds, models


class StudyCreate(BaseModel):
    """A new study: a name for people and its fixed config."""

    model_config = ConfigDict(extra="forbid")
    name: Annotated[Label, StringConstraints(min_length=1)]
    config: StudyTerms


class StudyPublic(BaseModel):
    """A study and where it stands."""

    id: int
    uid: str  # unique across coordinators; sites keep the study's state under "<id>-<uid>"
    name: str
    status: str
    config: StudyTerms
    created_by: str
    created_at: datetime
    updated_at: datetime
    completed_rounds: int  # rounds with a stored theta^g_t
    current_round: int | None  # number of the open or aggregating round
    latest_global_sha256: str | None  # theta^g of the last completed round (round 0 after start)
    # Each listed site: "approved" by its operator, "awaiting approval" (it trains for none of the
    # study's rounds until then), "declined" by its operator (it trains for none of them, unless the
    # study changes and is approved), or "not reported" (its agent has not looked at the study yet).
    approvals: dict[str, str] = {}
    # Differential privacy: epsilon (at delta) spent by the models released so far; None without DP.
    privacy: PrivacySpent | None = None


class UpdatePublic(BaseModel):
    """One site's update as the researcher sees it: sizes, weight and summaries, never tensors."""

    site: str
    num_examples: int
    sha256: str
    size: int
    weight: float | None  # w_k used in aggregation (None until the round completes)
    train_seconds: float
    received_at: datetime
    train_loss: float | None  # none in the final evaluation round, where nothing trains
    # this round's global evaluation model theta^g_t: the site's pooled contribution summarised, or only
    # too_few_records (filled in later)
    eval: MetricSummary | None
    local_eval: MetricSummary | None  # the site's personalised model: exact scalars computed at the site
    # buffered studies: the version of theta^g the update trained from, and the versions it lagged behind
    base_round: int | None = None
    staleness: int | None = None


class RoundPublic(BaseModel):
    """A round attempt with its per-site updates and pooled summaries."""

    id: int
    study_id: int
    number: int
    attempt: int
    kind: str  # "train", or "evaluate" for the final evaluation round T+1
    status: str
    participants: dict[str, float]  # site -> load factor
    opened_at: datetime
    deadline_at: datetime
    closed_at: datetime | None
    note: str
    base_sha256: str  # theta^g_{t-1}
    base_size: int | None  # its size in bytes, which each site downloads
    global_model_sha256: str | None  # theta^g_t once completed
    updates: list[UpdatePublic]
    pooled: PooledMetrics | None


class GlobalModelPublic(BaseModel):
    """A stored global model theta^g_t (and phi_0 at t = 0)."""

    round: int
    sha256: str
    size: int
    local_sha256: str | None
    created_at: datetime
    url: str
    local_url: str | None


class ModelUploaded(BaseModel):
    """A model file as the coordinator stored it (POST /models): an evaluate study's terms name it by `sha256`."""

    sha256: str
    size: int
    tensors: int  # how many named tensors it holds


class AuditEventPublic(_Public):
    """One audit event."""

    id: int
    at: datetime
    actor: str
    action: str
    study_id: int | None
    round_id: int | None
    site_id: int | None
    digest: str | None
    detail: dict[str, Any]


# Status


class StudyStatusLine(BaseModel):
    """A study in the status summary."""

    id: int
    name: str
    status: str
    rounds: int  # T
    completed_rounds: int
    current_round: int | None
    round_status: str | None
    updates_received: int | None  # in the current round
    participants: int | None
    awaiting_approval: list[str] = []  # listed sites whose operator has not approved the study
    declined: list[str] = []  # listed sites whose operator declined the study


class TransferProgress(BaseModel):
    """A site's transfer in an open round: theta^g_{t-1} going out to it, or its update coming in."""

    study_id: int
    round: int  # the round the transfer serves (its download is of the model of the round before)
    round_id: int
    # "download": the model, streamed to the site; "upload": the site's update, sent in an upload session.
    # A plain string, so that a client of this release still reads a status that names another direction.
    direction: str
    # sent to the site so far / held by the coordinator so far (a resumed transfer counts the bytes before its cut)
    bytes_done: int
    bytes_total: int  # the model's size / the update's size, as the site declared it


class SiteStatus(BaseModel):
    """A site in the status summary."""

    name: str
    last_seen_at: datetime | None
    current_task: dict[str, int] | None  # {"study_id", "round", "round_id"} it should be working on
    transfers: list[TransferProgress] = []  # its transfers under way in open rounds; none when nothing travels


class HealthReport(BaseModel):
    """GET /health: the coordinator answers, its release and protocol, and its database answers."""

    status: Literal["ok"]
    version: str  # the release, e.g. "0.6.0"
    protocol: int  # shared.wire.protocol.PROTOCOL_VERSION
    database: Literal["ok"]  # otherwise the answer is 503 database_unavailable


class StatusReport(BaseModel):
    """GET /api/v1/status: studies, round counts by status, sites."""

    time: datetime
    studies: list[StudyStatusLine]
    rounds: dict[str, int]  # status -> number of round attempts
    sites: list[SiteStatus]
