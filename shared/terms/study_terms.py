"""A study's terms: everything that decides what runs on a site's data and what leaves it, as one frozen type.

`StudyTerms` is the one shape a study has from `cardiofl study create` to a site's local round:
the researcher's TOML is validated into it (`read_terms_file`), the coordinator stores it as it is
(coordinator/models.py), tasks and offers embed it whole (shared/wire/protocol.py), a site's operator
approves its digest (shared/study/description.py), and the site builds every round from the terms it
approved (shared/study/round_terms.py), checking the per-round facts a task adds against them.

Every error names the field's path (`privacy.secure_aggregation.threshold`). The types are data: they check
what their fields say and import nothing above the wire (no torch). The rules that need the algorithm registry,
the privacy accounting or the secure-aggregation setup are shared/study/checks.py's `check_study`, which study
creation, the CLI and the site call where terms cross a process boundary (`checked_terms`).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, NoReturn

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StringConstraints,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from shared.errors import StudyRuleError
from shared.labels import CLASS_NAMES
from shared.plugins import PluginIdentity
from shared.terms.buffered import BufferedSpec
from shared.terms.field_names import did_you_mean
from shared.terms.model_config import NO_HEADS, PRESETS, ModelConfig, parse_heads, preset
from shared.terms.study_kinds import EvaluationSpec, StudyKind, SurveySpec, Terms

__all__ = [
    "AggregationSpec",
    "AlgorithmSpec",
    "DifferentialPrivacy",
    "EvaluationSpec",
    "ModelSpec",
    "ParticipationSpec",
    "PrivacyConfig",
    "SecureAggregation",
    "SiteName",
    "StudyKind",
    "StudyTerms",
    "SurveySpec",
    "TermsError",
    "TrainingConfig",
    "read_terms_file",
    "read_terms_table",
    "terms_from",
    "terms_of_table",
    "terms_problems",
]

SiteName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]
FieldPath = tuple[str | int, ...]
DEFAULT_HEADS = "6:2"  # a model's split unless the terms give one (of the presets of 8 heads)


class TermsError(StudyRuleError):
    """A study's terms are not valid; `problems` are "path: message" lines, one per error."""

    def __init__(self, problems: Sequence[str], source: str = "the study's terms") -> None:
        super().__init__(f"{source}: not valid study terms:\n" + "\n".join(f"  {line}" for line in problems))
        self.problems = list(problems)


def _refuse(path: FieldPath, message: str, value: Any = None) -> NoReturn:
    """Raise a validation error at `path` (relative to the model being validated)."""
    error = InitErrorDetails(type=PydanticCustomError("terms", message), loc=path, input=value)
    raise ValidationError.from_exception_data("StudyTerms", [error])


def terms_problems(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """Each error of a validation as "path: message" (the path as in the TOML, `model.site_heads.lyon`).

    An unknown key (a typo: `trainig`) names the field of `model` (default StudyTerms) it is closest to.
    """
    lines = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(part) for part in error["loc"]) or "(the terms)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden" and error["loc"]:
            message += did_you_mean(model or StudyTerms, error["loc"])
        lines.append(f"{path}: {message}")
    return lines


class ModelSpec(Terms):
    """Which model: a preset (a `cardiofl.models` entry point, shared/terms/model_config.py) and the head split H_g:H_l.

    A preset without attention (`resnet1d34`, and a plug-in's without dual-attention blocks) has no
    split: its `heads` is "-", the default for it; one of another H than 8 defaults to its own split.
    `site_heads` gives sites their own split (site -> "H_g:H_l", each of the model's H heads); a site
    it does not name takes `heads`. With it, both
    branches are held at full width and site k shares its first H_g,k heads
    (shared/algorithms/head_splits.py); `for_site` is a site's model. `plugin` names the installed
    distribution of a plug-in model, filled in by the coordinator as for an algorithm (AlgorithmSpec).
    """

    preset: str = "paper"
    heads: str = DEFAULT_HEADS
    site_heads: dict[SiteName, str] = Field(default_factory=dict)
    plugin: PluginIdentity | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_split_without_attention(cls, data: Any) -> Any:
        if isinstance(data, dict) and "heads" not in data and data.get("preset") in PRESETS:
            config = PRESETS[data["preset"]]
            if not config.has_attention:
                return {**data, "heads": NO_HEADS}
            if sum(parse_heads(DEFAULT_HEADS)) != config.n_heads:  # a plug-in's size: its own split
                return {**data, "heads": config.heads}
        return data

    @model_validator(mode="after")
    def _exists(self) -> ModelSpec:
        if self.preset not in PRESETS:
            _refuse(("preset",), f"unknown model preset {self.preset!r}; choose one of {sorted(PRESETS)}", self.preset)
        try:
            config = preset(self.preset, self.heads)
        except ValueError as exc:
            _refuse(("heads",), str(exc), self.heads)
        for site, split in self.site_heads.items():
            if not config.has_attention:
                _refuse(("site_heads",), f"preset {self.preset!r} has no attention heads to split", self.site_heads)
            try:
                n_global, n_local = parse_heads(split)
            except ValueError as exc:
                _refuse(("site_heads", site), str(exc), split)
            if n_global + n_local != config.n_heads:
                _refuse(
                    ("site_heads", site),
                    f"{split!r} splits {n_global + n_local} heads; the model has {config.n_heads} "
                    f"(model.heads = {self.heads!r})",
                    split,
                )
        return self

    @model_serializer(mode="wrap")
    def _without_empty_site_heads(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `site_heads` key when no site has its own split, nor `plugin` for a built-in: digests as before."""
        data: dict[str, Any] = handler(self)
        if not self.site_heads:
            data.pop("site_heads", None)
        if data.get("plugin") is None:
            data.pop("plugin", None)
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


class TrainingConfig(Terms):
    """Local training at a site (FedCVD defaults: plain SGD, lr 0.1, batch 32, one epoch)."""

    optimizer: Literal["sgd", "adam"] = "sgd"  # a fresh optimizer each round: no optimizer state is shared
    lr: float = Field(0.1, gt=0, le=100)
    momentum: float = Field(0.0, ge=0, lt=1)  # SGD only
    weight_decay: float = Field(0.0, ge=0, le=1)
    batch_size: int = Field(32, ge=1, le=65_536)
    local_epochs: int = Field(1, ge=1, le=1_000)
    max_steps: int | None = Field(None, ge=1)  # stop an epoch early after this many steps (tests, demos)


class _RuleSpec(Terms):
    """A named rule plus its parameters; shared/study/checks.py checks both against the rule's registry."""

    kind: ClassVar[str]
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class AlgorithmSpec(_RuleSpec):
    """The client algorithm, a name of shared/algorithms/registry.py ALGORITHMS.

    `plugin` names the installed distribution that provides a plug-in algorithm (shared/plugins.py),
    filled in by the coordinator when the study is created; absent for cardiofl's own, and then left
    out of the terms' JSON, so the digests of studies of built-in algorithms do not change.
    """

    kind = "algorithm"
    name: str = "fedavg"
    plugin: PluginIdentity | None = None

    @model_serializer(mode="wrap")
    def _without_absent_plugin(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        if dumped.get("plugin") is None:
            dumped.pop("plugin", None)
        return dumped


class AggregationSpec(_RuleSpec):
    """The server's aggregation weighting (shared/algorithms/weightings.py WEIGHTINGS)."""

    kind = "aggregation weighting"
    name: str = "samples"


class ParticipationSpec(_RuleSpec):
    """Which sites take part in each round (shared/algorithms/participation.py PARTICIPATIONS)."""

    kind = "participation policy"
    name: str = "all"


class DifferentialPrivacy(Terms):
    """Client-level DP of the released models (DP-FedAvg, McMahan et al. 2018): shared/study/dp.py."""

    noise_multiplier: float = Field(gt=0, le=1_000)  # z: the sum's noise has std z * Delta (C on the grid)
    clip_norm: float = Field(gt=0, le=1e6)  # C: each site's update theta_k - theta^g_{t-1} is clipped to this L2 norm
    # the coordinator adds the noise, or each site its share ("distributed" needs secure_aggregation)
    mode: Literal["central", "distributed"] = "central"
    delta: float = Field(1e-5, gt=0, lt=1)
    # the most epsilon the study may spend: one whose rounds would spend more is refused at creation (privacy_budget)
    epsilon_budget: float | None = Field(None, gt=0)
    accountant: Literal["rdp", "pld"] = "rdp"  # RDP; "pld" is refused for new studies (not proven for discrete noise)
    noise: Literal["discrete"] = "discrete"  # the discrete Gaussian on the grid, sampled exactly (privacy/discrete.py)


class SecureAggregation(Terms):
    """SecAgg+ (Bell et al. 2020 on Bonawitz et al. 2017), against a malicious coordinator: it learns only the sum.

    See shared/study/secure_setup.py for a round's parameters, coordinator/rounds/secure.py for its
    phases. Every site derives a round's setup from these terms and the round's participants itself.
    `colluding` is c, the most sites that may collude with the coordinator (default (K - 1) // 3 of
    the study's K sites): t is split-proof (2t > k + m, m of them among a site's k neighbours), and
    floor((K + c) / 2) + 1 survivors sign one survivor set before anyone reveals. `site_keys` are the
    sites' long-term Ed25519 public keys (hex), which sign their advertisements and the consistency
    check: the coordinator fills them in from the keys the sites registered when the study is
    created, so each site's approval covers every key.
    """

    phase_timeout_s: float = Field(600.0, gt=0, le=86_400)  # deadline of each phase after the first
    neighbour_count: int | None = Field(None, ge=1, le=10_000)  # k; even unless every other site is a neighbour
    threshold: int | None = Field(None, ge=1, le=10_000)  # t of the Shamir sharing: at most k, 2t > k + m
    fraction_bits: int = Field(24, ge=8, le=40)  # f of the fixed-point encoding: error <= K * 2^-(f+1)
    ring_bits: Literal[32, 64] = 32  # 32: w_k (theta_k - theta^g) in Z_{2^32}, |change| <= 2^(30-f); 64: w_k theta_k
    colluding: int | None = Field(None, ge=0, le=10_000)  # c: the most sites that may collude with the coordinator
    site_keys: dict[SiteName, Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]] = {}

    def colluding_among(self, site_count: int) -> int:
        """The colluding sites c among `site_count`: the terms' own c, else a third of the others, (K - 1) // 3."""
        return self.colluding if self.colluding is not None else (site_count - 1) // 3


class PrivacyConfig(Terms):
    """What a study lets leave a site beyond its shared tensors and n_k, and how the released models are protected."""

    # A site reports counts and histograms (the pooled Global statistics) only of at least this many
    # test records; below it, it reports "too few records" instead. Scalar metrics are not subject to it.
    min_records: int = Field(20, ge=1, le=1_000_000)
    dp: DifferentialPrivacy | None = None  # client-level differential privacy of every released theta^g_t
    secure_aggregation: SecureAggregation | None = None  # the coordinator sees only masked updates and their sum


class StudyTerms(Terms):
    """Everything that defines a federated study, fixed when it is created: what a site's operator approves."""

    sites: list[SiteName] = Field(min_length=1, max_length=10_000)  # the participating sites
    # train: federated training; survey: each site releases its data-readiness survey once, nothing is trained;
    # evaluate: each site evaluates another study's final model (`evaluation`), nothing is trained or uploaded
    kind: StudyKind = "train"
    survey: SurveySpec | None = None  # kind survey: how the counts are released (default: exact, suppressed)
    evaluation: EvaluationSpec | None = None  # kind evaluate: the model evaluated
    # External validation (kind train): sites that never train, never enter K, c, the quorum, the weights or
    # the secure setup; each evaluates every `validation_every`-th released theta^g (and the final one) on all
    # its records, reported apart from the training sites' test splits
    validation_sites: list[SiteName] = Field(default_factory=list, max_length=10_000)
    validation_every: int = Field(1, ge=1, le=100_000)
    model: ModelSpec = Field(default_factory=ModelSpec)
    labels: tuple[str, ...] = CLASS_NAMES  # the classes the model predicts, in its output order
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)
    participation: ParticipationSpec = Field(default_factory=ParticipationSpec)
    rounds: int = Field(50, ge=1, le=100_000)  # T communication rounds
    min_sites: int = Field(1, ge=1)  # quorum: no round's model is released from fewer sites' updates
    round_deadline_s: float = Field(3600.0, gt=0, le=30 * 86_400)
    round_retries: int = Field(2, ge=0, le=1_000)  # a round below quorum is retried this often, then the study fails
    seed: int = Field(0, ge=0, lt=2**63)  # round 0's model and every participation pick derive from it
    # Keep each site's uploaded tensors after its round is settled (audits, research); by default the
    # coordinator releases them once aggregated, keeping only their digests, sizes and metrics.
    keep_updates: StrictBool = False  # A JSON boolean: 0 or "false" is refused, not coerced.
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    buffered: BufferedSpec | None = None  # a buffered asynchronous study (shared/terms/buffered.py); None: rounds

    @model_serializer(mode="wrap")
    def _without_defaults_of_kinds(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A training study without validation sites dumps as before: its digest does not change."""
        data: dict[str, Any] = handler(self)
        if self.kind == "train":
            data.pop("kind", None)
        for key in ("survey", "evaluation", "buffered"):
            if data.get(key) is None:
                data.pop(key, None)
        if not self.validation_sites:
            data.pop("validation_sites", None)
            data.pop("validation_every", None)
        return data

    @property
    def listed_sites(self) -> list[str]:
        """Every site the study lists: its training sites, then its validation sites (all approve it)."""
        return [*self.sites, *self.validation_sites]

    @model_validator(mode="after")
    def _consistent(self) -> StudyTerms:
        if len(set(self.sites)) != len(self.sites):
            _refuse(("sites",), "sites must be distinct", self.sites)
        self._kind_parts()
        if self.min_sites > len(self.sites):
            _refuse(("min_sites",), f"min_sites {self.min_sites} exceeds the {len(self.sites)} sites", self.min_sites)
        if self.labels != CLASS_NAMES:
            _refuse(
                ("labels",),
                f"this release's models predict the {len(CLASS_NAMES)} FedCVD classes in their order: "
                f"{list(CLASS_NAMES)}",
                self.labels,
            )
        if self.algorithm.name == "learned_heads":
            self._learned_heads()
        if self.privacy.secure_aggregation is not None:
            self._secure_site_keys(self.privacy.secure_aggregation)
        if self.privacy.dp is not None and self.aggregation.name != "equal":
            _refuse(
                ("aggregation", "name"),
                "differential privacy weighs sites equally: set aggregation = equal (weights by n_k or H_k would "
                "raise a site's influence, and the noise, beyond the clipping norm)",
            )
        if self.model.site_heads:
            self._per_site_heads()
        return self

    def _kind_parts(self) -> None:
        """Each kind's own part is present for it alone; validation sites are a training study's, apart from sites."""
        if self.survey is not None and self.kind != "survey":
            _refuse(("survey",), f'a {self.kind} study has no survey settings: set kind = "survey"')
        if self.kind == "evaluate" and self.evaluation is None:
            _refuse(("evaluation",), "an evaluate study names the model it evaluates: a study's or a file's")
        if self.evaluation is not None and self.kind != "evaluate":
            _refuse(("evaluation",), f'a {self.kind} study evaluates no other model: set kind = "evaluate"')
        if self.validation_sites and self.kind != "train":
            _refuse(("validation_sites",), f"a {self.kind} study trains no model for validation sites to evaluate")
        if len(set(self.validation_sites)) != len(self.validation_sites):
            _refuse(("validation_sites",), "validation sites must be distinct", self.validation_sites)
        both = sorted(set(self.sites) & set(self.validation_sites))
        if both:
            _refuse(("validation_sites",), f"a validation site never trains: {both} are also in sites", both)
        if self.validation_sites and self.algorithm.name == "local":
            _refuse(("validation_sites",), "algorithm 'local' releases no shared model for validation sites")

    def _secure_site_keys(self, secure: SecureAggregation) -> None:
        """Signing keys, when the terms carry them, are those of exactly the study's sites."""
        if secure.site_keys and set(secure.site_keys) != set(self.sites):
            _refuse(
                ("privacy", "secure_aggregation", "site_keys"),
                f"names the signing keys of {sorted(secure.site_keys)}, the study's sites are {sorted(self.sites)}",
            )

    def _per_site_heads(self) -> None:
        """Per-site splits name study sites, differ somewhere, and run with a plain average (no DP)."""
        unknown = sorted(set(self.model.site_heads) - set(self.sites))
        if unknown:
            _refuse(("model", "site_heads"), f"names sites that are not in the study: {unknown}")
        splits = {self.model.split_of(site) for site in self.sites}
        if len(splits) == 1:
            _refuse(
                ("model", "site_heads"),
                f"gives every site the split {splits.pop()!r}: set model.heads to it and drop site_heads (a "
                "uniform split runs the compact model)",
            )
        if self.privacy.dp is not None:
            _refuse(
                ("privacy", "dp"),
                "per-site head splits (model.site_heads) run without differential privacy: clipping and noise do "
                "not yet account for per-head weights renormalised over the sites that hold each head",
            )

    def _learned_heads(self) -> None:
        """Learned heads need attention heads and one split for all sites, and run without DP."""
        if not self.model.config().has_attention:
            _refuse(
                ("algorithm", "name"),
                f"algorithm 'learned_heads' needs attention heads; preset {self.model.preset!r} has none",
            )
        if self.model.site_heads:
            _refuse(("model", "site_heads"), "algorithm 'learned_heads' learns each site's heads: drop site_heads")
        if self.privacy.dp is not None:
            _refuse(
                ("privacy", "dp"),
                "algorithm 'learned_heads' runs without differential privacy: clipping and noise do not yet "
                "account for per-head weights w_k (1 - g_k,h) renormalised per head",
            )


def terms_from(raw: Mapping[str, Any], source: str = "the study's terms") -> StudyTerms:
    """Validate `raw` (a study's config as TOML or JSON gives it) into StudyTerms; TermsError naming each path.

    The data alone: shared/study/checks.py `checked_terms` adds the rules that need more than the fields.
    """
    try:
        return StudyTerms.model_validate(raw)
    except ValidationError as exc:
        raise TermsError(terms_problems(exc), source) from None


def read_terms_table(path: Path) -> dict[str, Any]:
    """A study's TOML file as its table, `name` included; TermsError when it cannot be read."""
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TermsError([f"cannot read it: {exc}"], str(path)) from None


def terms_of_table(table: Mapping[str, Any], source: str) -> tuple[str | None, StudyTerms]:
    """(its `name`, if any; the terms) of a study's TOML table, as read from `source`."""
    raw = dict(table)
    name = raw.pop("name", None)
    return (str(name) if name is not None else None), terms_from(raw, source)


def read_terms_file(path: Path) -> tuple[str | None, StudyTerms]:
    """(its `name`, if any; the terms) of a study's TOML file, as `cardiofl study create` reads it."""
    return terms_of_table(read_terms_table(path), str(path))
