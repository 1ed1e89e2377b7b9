"""Wire models shared by the coordinator and the site agent: study config, tasks, updates, errors.

This module is the single definition of what crosses the network as JSON. Tensors travel as
safetensors bytes (shared/tensors.py); an update's metadata (`UpdateMeta`) rides inside the
safetensors header under `UPDATE_META_KEY`, so one body carries both and one sha256 covers both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from torch import Tensor

from shared.algorithms.weightings import WEIGHTINGS
from shared.model import NO_HEADS, PRESETS, ModelConfig, parse_heads, preset
from shared.registry import ALGORITHMS, PARTICIPATIONS, exchange_of
from shared.tensors import dump

__all__ = [
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_HEADER",
    "PROTOCOL_VERSION",
    "UPDATE_META_KEY",
    "AggregationSpec",
    "AlgorithmSpec",
    "ApprovalReport",
    "ErrorBody",
    "ErrorInfo",
    "EvalSummary",
    "ModelSpec",
    "DifferentialPrivacy",
    "ParticipationSpec",
    "PrivacyConfig",
    "SecureAggregation",
    "SecureRoundInfo",
    "SiteName",
    "StudyConfig",
    "StudyOffer",
    "TaskSpec",
    "TrainingConfig",
    "UpdateMeta",
    "UpdateMetrics",
    "UpdateReceipt",
    "encode_update",
]

UPDATE_META_KEY = "cardiofl.update"  # safetensors metadata key holding UpdateMeta as JSON

SiteName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]


# The protocol between coordinator and site agents. A site agent sends its version with every request
# (PROTOCOL_HEADER) and in every upload; every task carries the coordinator's. A coordinator refuses
# an agent older than MIN_PROTOCOL_VERSION; an agent declines a task of a version it does not know.
# 1: cardiofl 0.1 (no header); 2: tasks name the study's uid, which the site's store keys by;
# 3: tasks carry the whole study description, and a site trains only for studies its operator approved;
# 4: secure aggregation (SecAgg+): a secure round's task carries its setup and the site drives its phases.
PROTOCOL_VERSION = 4
MIN_PROTOCOL_VERSION = 4
PROTOCOL_HEADER = "Cardiofl-Protocol"


class _Input(BaseModel):
    """A model the receiver validates strictly: unknown keys and NaN/Inf are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Output(BaseModel):
    """A model the sender fills; receivers ignore keys they do not know yet (newer servers)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class ModelSpec(_Input):
    """Which DualAttentionResNet1D: a preset of shared/model.py and the head split H_g:H_l.

    A preset without attention (`resnet1d34`) has no split: its `heads` is "-", the default for it.
    `site_heads` gives sites their own split (site -> "H_g:H_l", each of the model's H heads); a
    site it does not name takes `heads`. With it, both branches are held at full width and site k
    shares its first H_g,k heads (shared/algorithms/head_splits.py); `for_site` is a site's model.
    """

    preset: str = "paper"
    heads: str = "6:2"
    site_heads: dict[SiteName, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _no_split_without_attention(cls, data: Any) -> Any:
        if isinstance(data, dict) and "heads" not in data and data.get("preset") in PRESETS:
            if not PRESETS[data["preset"]].has_attention:
                return {**data, "heads": NO_HEADS}
        return data

    @model_validator(mode="after")
    def _exists(self) -> ModelSpec:
        config = preset(self.preset, self.heads)  # raises ValueError naming the presets or the expected head format
        for site, split in self.site_heads.items():
            if not config.has_attention:
                raise ValueError(f"model.site_heads: preset {self.preset!r} has no attention heads to split")
            n_global, n_local = parse_heads(split)
            if n_global + n_local != config.n_heads:
                raise ValueError(
                    f"model.site_heads.{site} = {split!r} splits {n_global + n_local} heads; the model has "
                    f"{config.n_heads} (model.heads = {self.heads!r})"
                )
        return self

    @model_serializer(mode="wrap")
    def _without_empty_site_heads(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `site_heads` key when no site has its own split: uniform studies serialise (and digest) as before."""
        data = handler(self)
        if not self.site_heads:
            data.pop("site_heads", None)
        return data

    def config(self) -> ModelConfig:
        """The model's full config: at the split `heads`, at full width when sites have their own splits."""
        config = preset(self.preset, self.heads)
        return replace(config, full_width_heads=True) if self.site_heads else config

    def split_of(self, site: str) -> str:
        """The head split H_g:H_l of `site`."""
        return self.site_heads.get(site, self.heads)

    def for_site(self, site: str) -> ModelSpec:
        """The model `site` trains: its own split, at full width when the study has per-site splits."""
        if not self.site_heads:
            return self
        return self.model_copy(update={"heads": self.split_of(site)})


class TrainingConfig(_Input):
    """Local training at a site (FedCVD defaults: plain SGD, lr 0.1, batch 32, one epoch)."""

    optimizer: Literal["sgd", "adam"] = "sgd"  # a fresh optimizer each round: no optimizer state is shared
    lr: float = Field(0.1, gt=0, le=100)
    momentum: float = Field(0.0, ge=0, lt=1)  # SGD only
    weight_decay: float = Field(0.0, ge=0, le=1)
    batch_size: int = Field(32, ge=1, le=65_536)
    local_epochs: int = Field(1, ge=1, le=1_000)
    max_steps: int | None = Field(None, ge=1)  # stop an epoch early after this many steps (tests, demos)


class _RuleSpec(_Input):
    """A named rule from a registry plus its parameters, checked by the rule's own params model."""

    registry: ClassVar[Mapping[str, Any]]
    kind: ClassVar[str]
    name: str
    params: dict[str, Any] = Field(default_factory=dict, validate_default=True)

    @field_validator("params", mode="after")
    @classmethod
    def _known_rule_and_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("name")
        rule = cls.registry.get(name) if isinstance(name, str) else None
        if rule is None:
            raise ValueError(f"unknown {cls.kind} {name!r}; choose one of {sorted(cls.registry)}")
        try:
            return rule.params.model_validate(params).model_dump(mode="json")
        except ValidationError as exc:
            raise ValueError(f"bad params for {cls.kind} {name!r}: {exc.errors(include_url=False)}") from None

    def parsed_params(self) -> BaseModel:
        """The params as the rule's own typed model."""
        return self.registry[self.name].params.model_validate(self.params)


class AlgorithmSpec(_RuleSpec):
    """The client algorithm (shared/registry.py ALGORITHMS)."""

    registry = ALGORITHMS
    kind = "algorithm"
    name: str = "fedavg"


class AggregationSpec(_RuleSpec):
    """The server's aggregation weighting (shared/algorithms/weightings.py WEIGHTINGS)."""

    registry = WEIGHTINGS
    kind = "aggregation weighting"
    name: str = "samples"


class ParticipationSpec(_RuleSpec):
    """Which sites take part in each round (shared/registry.py PARTICIPATIONS)."""

    registry = PARTICIPATIONS
    kind = "participation policy"
    name: str = "all"


class DifferentialPrivacy(_Input):
    """Client-level DP of the released models (DP-FedAvg, McMahan et al. 2018): shared/privacy/study_dp.py."""

    noise_multiplier: float = Field(gt=0, le=1_000)  # z: the noise on the sum of the sites' updates has std z * C
    clip_norm: float = Field(gt=0, le=1e6)  # C: each site's update theta_k - theta^g_{t-1} is clipped to this L2 norm
    mode: Literal["central", "distributed"] = "central"  # the coordinator adds the noise, or each site its share
    delta: float = Field(1e-5, gt=0, lt=1)
    epsilon_budget: float | None = Field(None, gt=0)  # training ends before a round would take epsilon past it
    accountant: Literal["rdp", "pld"] = "rdp"  # dp-accounting's RDP (default) or PLD accountant


class SecureAggregation(_Input):
    """SecAgg+ (Bell et al. 2020 on Bonawitz et al. 2017): the coordinator learns only the weighted sum.

    See shared/privacy/study_secagg.py for the round's parameters and coordinator/secure_rounds.py
    for its phases. `neighbour_count` and `threshold` default per round to graph.py's choices.
    """

    phase_timeout_s: float = Field(600.0, gt=0, le=86_400)  # deadline of each phase after the first
    neighbour_count: int | None = Field(None, ge=1, le=10_000)  # k; even unless every other site is a neighbour
    threshold: int | None = Field(None, ge=1, le=10_000)  # t of the Shamir sharing (at most k)
    fraction_bits: int = Field(24, ge=8, le=40)  # f of the fixed-point encoding: error <= K * 2^-(f+1)


class PrivacyConfig(_Input):
    """What a study lets leave a site beyond its shared tensors and n_k, and how the released models are protected."""

    # A site reports counts and histograms (the pooled Global statistics) only of at least this many
    # test records; below it, it reports "too few records" instead. Scalar metrics are not subject to it.
    min_records: int = Field(20, ge=1, le=1_000_000)
    dp: DifferentialPrivacy | None = None  # client-level differential privacy of every released theta^g_t
    secure_aggregation: SecureAggregation | None = None  # the coordinator sees only masked updates and their sum


class StudyConfig(_Input):
    """Everything that defines a federated study; fixed when the study is created."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)
    participation: ParticipationSpec = Field(default_factory=ParticipationSpec)
    rounds: int = Field(50, ge=1, le=100_000)  # T communication rounds
    min_sites: int = Field(1, ge=1)  # quorum: a round closes at its deadline only with this many updates
    round_deadline_s: float = Field(3600.0, gt=0, le=30 * 86_400)
    round_retries: int = Field(2, ge=0, le=1_000)  # a round below quorum is retried this often, then the study fails
    seed: int = Field(0, ge=0, lt=2**63)  # round 0's model and every participation pick derive from it
    # Keep each site's uploaded tensors after its round is settled (audits, research); by default the
    # coordinator releases them once aggregated, keeping only their digests, sizes and metrics.
    keep_updates: bool = False
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    sites: list[SiteName] = Field(min_length=1, max_length=10_000)  # enrolled site names

    @model_validator(mode="after")
    def _consistent(self) -> StudyConfig:
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("sites must be distinct")
        if self.min_sites > len(self.sites):
            raise ValueError(f"min_sites {self.min_sites} exceeds the {len(self.sites)} enrolled sites")
        if self.algorithm.name == "learned_heads":
            self._learned_heads()
        if self.privacy.dp is not None:
            self._differentially_private(self.privacy.dp)
        if self.privacy.secure_aggregation is not None:
            from shared.privacy.study_secagg import check_secure_study

            check_secure_study(self)
        if self.model.site_heads:
            self._per_site_heads()
        return self

    def _per_site_heads(self) -> None:
        """Per-site splits name study sites, differ somewhere, and run with a plain average (no DP)."""
        unknown = sorted(set(self.model.site_heads) - set(self.sites))
        if unknown:
            raise ValueError(f"model.site_heads names sites that are not in the study: {unknown}")
        splits = {self.model.split_of(site) for site in self.sites}
        if len(splits) == 1:
            raise ValueError(
                f"model.site_heads gives every site the split {splits.pop()!r}: set model.heads to it and drop "
                "site_heads (a uniform split runs the compact model)"
            )
        if self.privacy.dp is not None:
            raise ValueError(
                "per-site head splits (model.site_heads) run without differential privacy: clipping and noise do "
                "not yet account for per-head weights renormalised over the sites that hold each head"
            )
        if not self.averages_model_tensors():
            raise ValueError(
                f"per-site head splits need an algorithm whose server takes the plain weighted average of model "
                f"tensors; {self.algorithm.name!r} uploads other tensors or updates theta^g its own way"
            )

    def _learned_heads(self) -> None:
        """Learned heads need attention heads and one split for all sites, and run without DP."""
        if not self.model.config().has_attention:
            raise ValueError(f"algorithm 'learned_heads' needs attention heads; preset {self.model.preset!r} has none")
        if self.model.site_heads:
            raise ValueError("algorithm 'learned_heads' learns each site's heads: drop model.site_heads")
        if self.privacy.dp is not None:
            raise ValueError(
                "algorithm 'learned_heads' runs without differential privacy: clipping and noise do not yet "
                "account for per-head weights w_k (1 - g_k,h) renormalised per head"
            )

    def averages_model_tensors(self) -> bool:
        """Whether the algorithm uploads model tensors only and the server takes their plain weighted average."""
        from shared.algorithms.server import ServerAggregator

        rule = ALGORITHMS[self.algorithm.name]
        params = self.algorithm.parsed_params()
        exchange = exchange_of(self.model.config(), self.algorithm.name, params)
        return not exchange.uploads and type(rule.server(params, len(self.sites))) is ServerAggregator

    def _differentially_private(self, dp: DifferentialPrivacy) -> None:
        """DP-FedAvg needs equal weights, an algorithm that uploads model tensors only and a plain average."""
        from shared.privacy.study_dp import trained_rounds

        if self.aggregation.name != "equal":
            raise ValueError(
                "differential privacy weighs sites equally: set aggregation = equal (weights by n_k or H_k "
                "would raise a site's influence, and the noise, beyond the clipping norm)"
            )
        if not self.averages_model_tensors():
            raise ValueError(
                f"differential privacy clips and averages model updates; algorithm {self.algorithm.name!r} "
                "uploads other tensors or updates theta^g its own way"
            )
        if trained_rounds(dp, self.rounds) < 1:
            raise ValueError(f"privacy.dp.epsilon_budget {dp.epsilon_budget} does not allow a single round")


class SecureRoundInfo(_Output):
    """A secure round's public setup (shared.privacy.messages.RoundSetup) and where its phases go."""

    site_number: int  # this site's number: its Shamir point
    sites: dict[str, int]  # every participant's number (1..K, participants in sorted order)
    graph_seed: str = Field(pattern=r"^[0-9a-f]{64}$")  # public seed of the neighbour graph
    neighbour_count: int
    threshold: int
    min_survivors: int
    fraction_bits: int
    url: str  # GET: the round's phase and what this site needs from it; POST .../advertisement, shares, reveal


class TaskSpec(_Output):
    """What a site is asked to do in one round: train from theta^g_{t-1} and upload its shared tensors.

    In every round the site also reports statistics of theta^g_{t-1} itself (the global evaluation
    model); the final `evaluate` round T+1 asks only for those, of theta^g_T, with no tensors.
    """

    protocol: int = 1  # the coordinator's PROTOCOL_VERSION (absent before version 2)
    study_id: int
    study_uid: str = Field(pattern=r"^[0-9a-f]{32}$")  # unique across coordinators: the site's store keys by it
    round_id: int  # this round attempt's id: uploads go to update_url, which names it
    round: int  # t, from 1
    attempt: int  # 1, or more when a round below quorum was retried
    kind: Literal["train", "evaluate"] = "train"  # evaluate: the final round, statistics of theta^g_T only
    site: str
    training: TrainingConfig
    load_factor: float  # |all sites| / |selected sites|: scale local steps by it
    algorithm: AlgorithmSpec
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)  # what to report for the weighting
    model: ModelSpec
    seed: int  # the study's seed
    # The rest of the study's description (protocol 3), so the site can check what it approved.
    rounds: int = 1  # T
    participation: ParticipationSpec = Field(default_factory=ParticipationSpec)
    keep_updates: bool = False
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    min_sites: int = 1  # the quorum: a distributed-DP site sizes its noise share for it
    global_model_round: int  # t - 1
    global_model_sha256: str  # digest (and ETag) of theta^g_{t-1}
    global_model_url: str  # GET: theta^g_{t-1} as safetensors
    initial_local_sha256: str  # digest of phi_0, the untrained local tensors of round 0
    initial_local_url: str  # GET: phi_0 as safetensors
    update_url: str  # POST: the update (safetensors with UpdateMeta in its metadata)
    deadline: datetime
    secure: SecureRoundInfo | None = None  # protocol 4: a secure round (the update is the masked vector)


ApprovalState = Literal["approved", "awaiting_approval"]  # what a site reports of a study it was offered


class ApprovalReport(_Input):
    """A site tells the coordinator whether its operator approved a study, and the digest it computed."""

    state: ApprovalState
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # shared.study_description.StudyDescription.digest()


class StudyOffer(_Output):
    """A study that lists the calling site, with what the site needs to describe it (and approve it)."""

    protocol: int  # the coordinator's PROTOCOL_VERSION: the version of the study's tasks
    study_id: int
    study_uid: str = Field(pattern=r"^[0-9a-f]{32}$")
    name: str
    status: str  # the study's state (draft, running, paused, completed, failed, cancelled)
    sites: int  # how many sites the study lists
    model: ModelSpec
    training: TrainingConfig
    algorithm: AlgorithmSpec
    aggregation: AggregationSpec
    participation: ParticipationSpec
    rounds: int
    seed: int
    keep_updates: bool
    privacy: PrivacyConfig
    min_sites: int = 1
    approval: ApprovalReport | None = None  # what this site last reported, None before it did


MAX_METRIC = 1e12  # the largest magnitude of any number a site reports (losses, rates, statistics)


def _check_numbers(value: Any, path: str) -> None:
    """ValueError naming the first number under `value` that is not finite or exceeds MAX_METRIC."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        if not (math.isfinite(value) and abs(value) <= MAX_METRIC):
            raise ValueError(f"{path} is {value!r}: every reported number must be finite and at most {MAX_METRIC:g}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_numbers(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_numbers(item, f"{path}[{index}]")


class EvalSummary(_Input):
    """Scalar metrics of one model on one site's test split, computed exactly at the site (shared.metrics)."""

    n_samples: StrictInt = Field(ge=1)  # test records
    loss: float = Field(ge=0, le=MAX_METRIC)  # mean per-record BCE
    micro_f1: float = Field(ge=0, le=1)
    map: float = Field(ge=0, le=1)  # mean AP over all classes, absent ones scoring 0 (FedCVD)
    map_present: float | None = Field(ge=0, le=1)  # over the classes with positives; None without any


def _check_scalar_reports(extra: Mapping[str, Any]) -> None:
    """ValueError naming a report beyond the declared ones that is not a scalar (a list, counts, histograms)."""
    for key, value in extra.items():
        if value is not None and not isinstance(value, str | int | float):
            raise ValueError(
                f"metrics.{key}: a site reports scalar metrics only; counts and histograms go only into "
                "eval_stats, the pooled statistics"
            )


class UpdateMetrics(BaseModel):
    """Aggregate statistics a site reports with its update; never per-sample data (DESIGN §7).

    `local_eval` is the site's personalised model on its test split, as scalars computed exactly at
    the site. `eval_stats` is the global evaluation model on the site's test split as its
    contribution to the pooled statistics: `shared.metrics.EvalStats.to_dict()` (counts and
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
        data = handler(self)
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
            raise ValueError(f"safetensors metadata lacks the {UPDATE_META_KEY!r} entry (UpdateMeta as JSON)")
        return cls.model_validate_json(raw)


def encode_update(tensors: Mapping[str, Tensor], meta: UpdateMeta) -> bytes:
    """The body of an update upload: the shared tensors as safetensors, `meta` in the header."""
    return dump(tensors, meta.to_metadata())


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


class ErrorInfo(_Output):
    """A refusal: `code` is stable and machine-readable, `message` is for people."""

    code: str
    message: str


class ErrorBody(_Output):
    """Every error response's JSON body."""

    error: ErrorInfo
