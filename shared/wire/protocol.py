"""Wire models shared by the coordinator and the site agent: tasks, offers, updates, errors.

This module is the single definition of what crosses the network as JSON between a site and its
coordinator (plain pydantic: no torch). A study's terms (shared/terms/study_terms.py) ride whole inside every
task and offer; what a task adds are the round's facts, which a site checks against the terms its
operator approved (shared/study/round_terms.py). Tensors travel as safetensors bytes (shared/tensors/codec.py);
an update's metadata (`UpdateMeta`) rides inside the safetensors header under `UPDATE_META_KEY`
(shared/tensors/update_body.py), so one body carries both and one sha256 covers both.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    model_serializer,
    model_validator,
)

from shared.errors import FormatError, MetricsError
from shared.terms import SiteName, StudyTerms

__all__ = [
    "RoundKind",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_HEADER",
    "PROTOCOL_VERSION",
    "UPDATE_META_KEY",
    "ApprovalReport",
    "ErrorBody",
    "ErrorInfo",
    "EvalSummary",
    "SecureRoundInfo",
    "StudyOffer",
    "TaskDecline",
    "TaskSpec",
    "UpdateMeta",
    "UpdateMetrics",
    "UpdateReceipt",
    "UPLOAD_OFFSET_HEADER",
    "UPLOAD_SHA256_HEADER",
    "UploadSessionView",
]

UPDATE_META_KEY = "cardiofl.update"  # safetensors metadata key holding UpdateMeta as JSON


# The protocol between coordinator and site agents. A site agent sends its version with every request
# (PROTOCOL_HEADER) and in every upload; every task carries the coordinator's. A coordinator refuses
# an agent older than MIN_PROTOCOL_VERSION; an agent declines a task of a version it does not know.
# 1: cardiofl 0.1 (no header); 2: tasks name the study's uid, which the site's store keys by;
# 3: tasks carry the whole study description, and a site trains only for studies its operator approved;
# 4: secure aggregation (SecAgg+): a secure round's task carries its setup and the site drives its phases;
# 5: tasks and offers embed the study's terms whole (shared/terms/study_terms.py), tasks name the round's participants,
#    a site derives each round from the terms it approved and declines a task that disagrees;
# 6: secure rounds are split-proof against a lying coordinator with c colluders (2t > k + m, a quorum of
#    floor((K + c) / 2) + 1 consistency signatures, named in the task), and a secure round relays each
#    advertisement's n_k and only the scalars the study's weighting reads.
PROTOCOL_VERSION = 6
MIN_PROTOCOL_VERSION = 6
PROTOCOL_HEADER = "Cardiofl-Protocol"
UPLOAD_OFFSET_HEADER = "Upload-Offset"  # an upload session's acknowledged bytes; a chunk's first byte (tus)
UPLOAD_SHA256_HEADER = "Upload-Sha256"  # an update's sha256, sent with it: a cut upload resumes (upload sessions)


class RoundKind(StrEnum):
    """What sites do in a round: train (and report), or only evaluate the final global model theta^g_T.

    One enum for both sides: the coordinator stores it with each round, a task carries it, and a site
    chooses its round's workflow from it (site_agent/site_rounds.py).
    """

    TRAIN = "train"
    EVALUATE = "evaluate"  # after the last training round: every site evaluates theta^g_T, nothing is averaged


class _Input(BaseModel):
    """A model the receiver validates strictly: unknown keys and NaN/Inf are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Output(BaseModel):
    """A model the sender fills; receivers ignore keys they do not know yet (newer servers)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class SecureRoundInfo(_Output):
    """A secure round's public setup (shared.privacy.messages.RoundSetup) and where its phases go.

    The site derives all of it from the terms, the round's participants and (study uid, round,
    attempt) itself (shared/study/round_terms.py) and declines a task whose setup differs.
    """

    site_number: int  # this site's number: its Shamir point
    sites: dict[str, int]  # every participant's number (1..K, participants in sorted order)
    graph_seed: str = Field(pattern=r"^[0-9a-f]{64}$")  # public seed of the neighbour graph
    neighbour_count: int
    threshold: int
    signature_quorum: int  # valid consistency signatures on one survivor set before a survivor reveals
    min_survivors: int
    fraction_bits: int
    ring_bits: int  # of the model's changes (32) or values (64); a task without it is of a release before 32
    url: str  # GET: the round's phase and what this site needs from it; POST .../advertisement, shares, reveal


class TaskSpec(_Output):
    """What a site is asked to do in one round: the study's terms whole, and the round's facts beside them.

    In every round the site also reports statistics of theta^g_{t-1} itself (the global evaluation
    model); the final `evaluate` round T+1 asks only for those, of theta^g_T, with no tensors. The
    site checks every fact below against the terms its operator approved before it trains
    (shared/study/round_terms.py `check_task`); a task that disagrees is declined (`decline_url`).
    """

    protocol: int = 1  # the coordinator's PROTOCOL_VERSION (absent before version 2)
    study_id: int
    study_uid: str = Field(pattern=r"^[0-9a-f]{32}$")  # unique across coordinators: the site's store keys by it
    site: str
    terms: StudyTerms
    round_id: int  # this round attempt's id: uploads go to update_url, which names it
    round: int  # t, from 1
    attempt: int  # 1, or more when a round below quorum was retried
    kind: RoundKind = RoundKind.TRAIN  # evaluate: the final round, statistics of theta^g_T only
    participants: list[SiteName]  # the sites selected for this attempt, sorted
    load_factor: float  # |all sites| / |selected sites|: scale local steps by it
    global_model_round: int  # t - 1
    global_model_sha256: str  # digest (and ETag) of theta^g_{t-1}
    global_model_url: str  # GET: theta^g_{t-1} as safetensors
    initial_local_sha256: str  # digest of phi_0, the untrained local tensors of round 0
    initial_local_url: str  # GET: phi_0 as safetensors
    update_url: str  # POST: the update (safetensors with UpdateMeta in its metadata)
    decline_url: str  # POST a TaskDecline: the site will not do this task, and why
    deadline: datetime
    secure: SecureRoundInfo | None = None  # a secure round (the update is the masked vector)


class TaskDecline(_Input):
    """A site will not do a task: its reason, for the coordinator's audit trail (`task.declined`)."""

    reason: str = Field(min_length=1, max_length=2_000)


ApprovalState = Literal["approved", "awaiting_approval", "declined"]  # what a site reports of a study it was offered


class ApprovalReport(_Input):
    """A site tells the coordinator whether its operator approved a study, and the digest it computed."""

    state: ApprovalState
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # shared.study.description.StudyDescription.digest()


class StudyOffer(_Output):
    """A study that lists the calling site: its terms whole, what the site needs to describe them and approve."""

    protocol: int  # the coordinator's PROTOCOL_VERSION: the version of the study's tasks
    study_id: int
    study_uid: str = Field(pattern=r"^[0-9a-f]{32}$")
    site: str  # the calling site, as the coordinator knows it
    name: str
    status: str  # the study's state (draft, running, paused, completed, failed, cancelled)
    terms: StudyTerms
    approval: ApprovalReport | None = None  # what this site last reported, None before it did


MAX_METRIC = 1e12  # the largest magnitude of any number a site reports (losses, rates, statistics)


def _check_numbers(value: Any, path: str) -> None:
    """ValueError naming the first number under `value` that is not finite or exceeds MAX_METRIC."""
    found = _first_bad_number(value)
    if found is not None:
        where, number = found
        raise MetricsError(
            f"{path}{where} is {number!r}: every reported number must be finite and at most {MAX_METRIC:g}"
        )


def _first_bad_number(value: Any) -> tuple[str, Any] | None:
    """(where under `value`, the number) of the first number not within +-MAX_METRIC (NaN and inf are not); else None.

    The path is spelt only for the number found: a report holds tens of thousands of numbers (curves, bins).
    """
    if isinstance(value, int | float):  # bool too: 0 and 1 are within
        return None if -MAX_METRIC <= value <= MAX_METRIC else ("", value)
    if isinstance(value, Mapping):
        items: Any = value.items()
        spell = ".{}".format
    elif isinstance(value, list | tuple):
        items, spell = enumerate(value), "[{}]".format
    else:
        return None
    for key, item in items:
        if type(item) is float or type(item) is int:
            if -MAX_METRIC <= item <= MAX_METRIC:
                continue
            return spell(key), item
        found = _first_bad_number(item)
        if found is not None:
            return spell(key) + found[0], found[1]
    return None


Fraction = Annotated[float | None, Field(ge=0, le=1)]


class EvalSummary(_Input):
    """Scalar metrics of one model on one site's test split, computed exactly at the site (shared/evaluation)."""

    n_samples: StrictInt = Field(ge=1)  # test records
    loss: float = Field(ge=0, le=MAX_METRIC)  # mean per-record BCE
    micro_f1: float = Field(ge=0, le=1)
    map: float = Field(ge=0, le=1)  # mean AP over all classes, absent ones scoring 0 (FedCVD)
    map_present: float | None = Field(ge=0, le=1)  # over the classes with positives; None without any
    # clinical figures (shared/evaluation/bootstrap.py), of at least privacy.min_records records only; each
    # `_low`/`_high` pair the ends of its 95% bootstrap interval; None where undefined
    micro_f1_low: Fraction = None
    micro_f1_high: Fraction = None
    map_low: Fraction = None
    map_high: Fraction = None
    auroc_classes: StrictInt | None = Field(default=None, ge=0)  # classes with both kinds the macros average
    macro_auroc: Fraction = None
    macro_auroc_low: Fraction = None
    macro_auroc_high: Fraction = None
    balanced_accuracy: Fraction = None
    balanced_accuracy_low: Fraction = None
    balanced_accuracy_high: Fraction = None
    sensitivity: Fraction = None
    sensitivity_low: Fraction = None
    sensitivity_high: Fraction = None
    specificity: Fraction = None
    specificity_low: Fraction = None
    specificity_high: Fraction = None
    ece: Fraction = None
    ece_low: Fraction = None
    ece_high: Fraction = None

    @model_serializer(mode="wrap")
    def _as_reported(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Only what the site set: a report without clinical figures carries no key of them, not even null."""
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if key in self.model_fields_set}


def _check_scalar_reports(extra: Mapping[str, Any]) -> None:
    """ValueError naming a report beyond the declared ones that is not a scalar (a list, counts, histograms)."""
    for key, value in extra.items():
        if value is not None and not isinstance(value, str | int | float):
            raise MetricsError(
                f"metrics.{key}: a site reports scalar metrics only; counts and histograms go only into "
                "eval_stats, the pooled statistics"
            )


class UpdateMetrics(BaseModel):
    """Aggregate statistics a site reports with its update; never per-sample data (docs/data-owner/privacy.md).

    `local_eval` is the site's personalised model on its test split, as scalars computed exactly at
    the site. `eval_stats` is the global evaluation model on the site's test split as its
    contribution to the pooled statistics: `shared.evaluation.metrics.EvalStats.to_dict()` (counts and
    histograms) of at least the study's `privacy.min_records` records, else `{"too_few_records":
    true}`. Every other key is kept as reported and must be a scalar.
    """

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    loss: float = Field(ge=0, le=MAX_METRIC)  # mean training loss of the round (BCE and penalties: >= 0)
    eval_stats: dict[str, Any] | None = None
    local_eval: EvalSummary | None = None

    @model_validator(mode="after")
    def _bounded_numbers(self) -> UpdateMetrics:
        """Every number reported, however deeply nested, is finite and at most MAX_METRIC in size.

        What a site reports is stored and served as JSON, which has no NaN or Infinity, and pooled
        across sites, where a finite but absurd value (1e308) would overflow.
        """
        _check_numbers({**self.__dict__, **(self.__pydantic_extra__ or {})}, "metrics")
        _check_scalar_reports(self.__pydantic_extra__ or {})
        return self


class UpdateMeta(_Input):
    """What accompanies a site's shared tensors: n_k, metrics and how long training took."""

    protocol: StrictInt = Field(PROTOCOL_VERSION, ge=1)  # the sending agent's (its requests' header says it too)
    num_examples: StrictInt = Field(gt=0)  # n_k: training examples seen by the site this round (a JSON integer)
    metrics: UpdateMetrics
    train_seconds: float = Field(ge=0, le=MAX_METRIC)
    # learned heads (shared/algorithms/learned_heads.py): u_{b,h} = 1 - g_{b,h}, (blocks, H) values in [0, 1]
    head_usage: list[list[Annotated[float, Field(ge=0, le=1)]]] | None = None

    @model_serializer(mode="wrap")
    def _without_head_usage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `head_usage` key unless the algorithm learns heads: every other upload's bytes are as before."""
        data: dict[str, Any] = handler(self)
        if self.head_usage is None:
            data.pop("head_usage", None)
        return data

    def to_metadata(self) -> dict[str, str]:
        """The safetensors metadata that carries this meta."""
        return {UPDATE_META_KEY: self.model_dump_json()}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> UpdateMeta:
        """Read the meta out of an upload's safetensors metadata; ValueError when absent or invalid."""
        raw = metadata.get(UPDATE_META_KEY)
        if raw is None:
            raise FormatError(f"safetensors metadata lacks the {UPDATE_META_KEY!r} entry (UpdateMeta as JSON)")
        return cls.model_validate_json(raw)


class UpdateReceipt(_Output):
    """The coordinator's acknowledgement of an update; the same bytes again give the same receipt."""

    study_id: int
    round_id: int
    round: int
    site: str
    sha256: str  # of the uploaded bytes
    size: int
    num_examples: int
    received_at: datetime


class UploadSessionView(_Output):
    """An upload session of an update that arrived in part: where the rest goes, from which byte."""

    url: str
    offset: int  # the bytes the coordinator holds: the next chunk starts here
    size: int
    sha256: str


class ErrorInfo(_Output):
    """A refusal: `code` is stable and machine-readable, `message` is for people."""

    code: str
    message: str


class ErrorBody(_Output):
    """Every error response's JSON body."""

    error: ErrorInfo
