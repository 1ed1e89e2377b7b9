"""An experiment: sites, a grid of methods x head splits x seeds, and the study settings every run shares."""

from __future__ import annotations

import itertools
import tomllib
from importlib.resources import files
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.algorithms.learned_heads import LEARNED_HEADS, LEARNED_SPLIT
from shared.model.network import NO_HEADS, head_ratios, parse_heads, preset
from shared.study.checks import checked_terms
from shared.terms import (
    AggregationSpec,
    AlgorithmSpec,
    BufferedSpec,
    ModelSpec,
    ParticipationSpec,
    PrivacyConfig,
    StudyTerms,
    TrainingConfig,
)
from site_agent.data.config import DataSourceConfig
from site_agent.data.planted import PlantedSpec

__all__ = [
    "LEARNED",
    "ExperimentConfig",
    "Method",
    "RunKey",
    "SiteSpec",
    "SyntheticSites",
    "load_experiment",
    "shipped_experiments",
]

# The head split of a `learned_heads` method's runs: each site learns its own
# (docs/researcher/model.md, "Learned head assignment").
LEARNED = LEARNED_SPLIT


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SiteSpec(_Strict):
    """One simulated hospital: a name and its data sources (real folders, a manifest ...).

    Each `data` entry is a site agent's source table (site_agent/data/config.py): `kind` (challenge,
    ptbxl, manifest or sph), `path`, and optionally `name`, `label_map`, `seed`, `test_fraction`,
    `split_file` (CSV record,split), `fedcvd_split` (FedCVD's appendix/ECG/clientK folder: its
    train.csv/test.csv keyed by ECG_ID) and `require_demographics` (FedCVD's record set: 0 < age < 120
    and a known sex; `fedcvd_split` needs it). Records dropped or left unmatched are counted per reason
    in the site's load report.
    """

    name: str
    data: list[DataSourceConfig] = Field(min_length=1)


class SyntheticSites(_Strict):
    """Sites made by the synthetic generator (site_agent.data.synthetic)."""

    sites: int = Field(4, ge=1)
    records_per_site: int = Field(300, ge=10)
    seed: int = 0
    heterogeneity: float = Field(1.0, ge=0)
    exclusive_classes: int = Field(0, ge=0, lt=20)  # the last N classes: primary labels of the last site alone


class Method(_Strict):
    """One row family of the results table: a client algorithm with an aggregation weighting."""

    label: str  # e.g. "FedDualAtt", "FedProx"
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)
    # head splits of this method; default: the experiment's `heads`, or ["learned"] under learned_heads
    heads: list[str] | None = None
    preset: str | None = None  # model preset of this method (e.g. "resnet1d34", heads ["-"]); default: the experiment's
    buffered: BufferedSpec | None = None  # a buffered asynchronous study (FedBuff) instead of synchronous rounds
    # this method's own participation policy, rounds (releases) and round deadline in simulated seconds
    # (a synchronous round goes on without a site whose site_seconds x load exceed it); default: the experiment's
    participation: ParticipationSpec | None = None
    rounds: int | None = Field(None, ge=1)
    round_deadline_s: float | None = Field(None, gt=0)

    @property
    def learned(self) -> bool:
        """Whether the sites learn their head assignment (algorithm learned_heads) rather than take a fixed split."""
        return self.algorithm.name == LEARNED_HEADS

    def splits(self, default: list[str]) -> list[str]:
        """The head splits this method runs: its own, else ["learned"] under learned_heads, else `default`."""
        if self.heads is not None:
            return self.heads
        return [LEARNED] if self.learned else default

    @model_validator(mode="after")
    def _learned_alone(self) -> Method:
        fixed = self.learned and self.heads not in (None, [LEARNED])
        if fixed or not self.learned and LEARNED in (self.heads or []):
            raise ValueError(
                f"method {self.label!r}: the head split {LEARNED!r} belongs to algorithm {LEARNED_HEADS!r}, which "
                f"learns each site's split and runs no other (heads = [{LEARNED!r}] or none)"
            )
        return self


class RunResources(_Strict):
    """What one run of the grid asks of a Ray cluster (`--backend ray`); its torch threads are its whole CPUs."""

    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)  # 0: a CPU-only cluster works


class RunKey(_Strict):
    """One run of the grid."""

    method: str
    heads: str
    seed: int

    @property
    def id(self) -> str:
        """A stable identifier, used to resume."""
        return f"{self.method}|{self.heads}|{self.seed}"


class ExperimentConfig(_Strict):
    """What `cardiofl experiment run` runs: every (method, head split, seed) is one federated study."""

    name: str
    sites: list[SiteSpec] = Field(default_factory=list)
    synthetic: SyntheticSites | None = None  # used when `sites` is empty
    planted: PlantedSpec | None = None  # used when `sites` is empty and there is no `synthetic` table
    preset: str = "small"  # model preset of shared/model/network.py
    heads: list[str] = Field(default_factory=lambda: ["6:2"])  # "all" is every split 8:0 ... 0:8
    methods: list[Method] = Field(default_factory=lambda: [Method(label="FedDualAtt")])
    seeds: list[int] = Field(default_factory=lambda: [0])
    rounds: int = Field(5, ge=1)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    participation: ParticipationSpec = Field(default_factory=ParticipationSpec)
    # Small public data sets may lower privacy.min_records so that their test splits still enter the
    # pooled Global metrics; the report says so.
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    # External validation: sites (named as above, or "site-3" of a synthetic or planted table) that never train
    # nor enter any aggregation; each evaluates every `validation_every`-th released theta^g and the final one,
    # as the study's global evaluation model, on all its records (recorded per round as "external")
    validation_sites: list[str] = Field(default_factory=list)
    validation_every: int = Field(1, ge=1)
    device: str = "auto"
    cache_dir: Path = Path(".cardiofl/experiments/cache")
    resources: RunResources = Field(default_factory=RunResources)  # per run, on a Ray cluster
    # simulated seconds of one local round at each named site (others 1): each round record's `clock`, the
    # buffers of buffered methods, the sites a round deadline drops, and centre dropout's "slowest"
    site_seconds: dict[str, float] = Field(default_factory=dict)
    # each round's record also holds theta^g_t with phi_0 on every training site's test split (`global_by_site`)
    site_readings: bool = False

    @model_validator(mode="before")
    @classmethod
    def _expand_all_heads(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("heads") == "all":
            data = {**data, "heads": head_ratios(8)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        if [bool(self.sites), self.synthetic is not None, self.planted is not None].count(True) != 1:
            raise ValueError("give one of `sites` (data folders), a `synthetic` table or a `planted` table")
        if LEARNED in self.heads:
            raise ValueError(f"heads: {LEARNED!r} is the split of a {LEARNED_HEADS} method, not the experiment's")
        for heads in self.heads + [h for m in self.methods for h in m.heads or []]:
            if heads not in (NO_HEADS, LEARNED):
                parse_heads(heads)
        unknown = sorted(set(self.validation_sites) - set(self.site_names()))
        if unknown:
            raise ValueError(f"validation_sites: {unknown} are not among the experiment's sites {self.site_names()}")
        unknown = sorted(set(self.site_seconds) - set(self.training_sites()))
        if unknown or any(not 0 < s < float("inf") for s in self.site_seconds.values()):
            raise ValueError(f"site_seconds: give > 0 seconds for training sites only (not {unknown or 'these'})")
        labels = [m.label for m in self.methods]
        if len(set(labels)) != len(labels):
            raise ValueError(f"method labels must be unique: {labels}")
        for key in self.runs():
            self.study(key)  # every grid point is a valid study
        return self

    def with_seeds(self, seeds: list[int]) -> ExperimentConfig:
        """The same experiment over other seeds (validated again)."""
        return ExperimentConfig.model_validate({**self.model_dump(), "seeds": seeds})

    def site_names(self) -> list[str]:
        """Every simulated site, training or validating, in the order the coordinator would sort them."""
        if self.sites:
            return [site.name for site in self.sites]
        if self.synthetic is not None:
            return [f"site-{i + 1}" for i in range(self.synthetic.sites)]
        assert self.planted is not None
        return [f"site-{i + 1}" for i in range(len(self.planted.local_heads))]

    def training_sites(self) -> list[str]:
        """The sites that train: every simulated site but the validation sites."""
        return [name for name in self.site_names() if name not in self.validation_sites]

    def runs(self) -> list[RunKey]:
        """Every (method, head split, seed) of the grid, in the order they run."""
        keys = []
        for method in self.methods:
            for heads, seed in itertools.product(method.splits(self.heads), self.seeds):
                keys.append(RunKey(method=method.label, heads=heads, seed=seed))
        return keys

    def method(self, label: str) -> Method:
        """The method with this label."""
        return next(m for m in self.methods if m.label == label)

    def study(self, key: RunKey) -> StudyTerms:
        """The study config one run simulates: exactly what a coordinator would be given."""
        method = self.method(key.method)
        sites = self.training_sites()
        name = method.preset or self.preset
        # learned heads: the gated model holds every head in both branches, so the split does not shape it
        heads = preset(name).heads if key.heads == LEARNED else key.heads
        terms = StudyTerms(
            model=ModelSpec(preset=name, heads=heads),
            training=self.training,
            algorithm=method.algorithm,
            aggregation=method.aggregation,
            participation=method.participation or self.participation,
            privacy=self.privacy,
            rounds=method.rounds or self.rounds,
            **({"round_deadline_s": method.round_deadline_s} if method.round_deadline_s else {}),
            min_sites=1,
            seed=key.seed,
            sites=sites,
            validation_sites=self.validation_sites,
            validation_every=self.validation_every,
            buffered=method.buffered,
        )
        return checked_terms(terms, f"run {key.id}")


def shipped_experiments() -> list[str]:
    """The names of the experiments shipped in cardiofl/experiment/configs."""
    folder = files("cardiofl.experiment").joinpath("configs")
    return sorted(entry.name.removesuffix(".toml") for entry in folder.iterdir() if entry.name.endswith(".toml"))


def load_experiment(name_or_path: str | Path) -> ExperimentConfig:
    """An experiment from a TOML file, or a shipped one by name (cardiofl/experiment/configs: `cpu`, `paper` ...)."""
    path = Path(name_or_path)
    if not path.exists():
        shipped = files("cardiofl.experiment").joinpath(f"configs/{name_or_path}.toml")
        if not shipped.is_file():
            shipped_ones = ", ".join(shipped_experiments())
            raise FileNotFoundError(f"no experiment file {name_or_path} (shipped ones: {shipped_ones})")
        return ExperimentConfig.model_validate(tomllib.loads(shipped.read_text()))
    return ExperimentConfig.model_validate(tomllib.loads(path.read_text()))
