"""What `cardiofl demo` runs: its plan and the study's terms built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DemoPlan", "held_out", "slow_site", "study_config", "title"]


@dataclass
class DemoPlan:
    """What the demo runs."""

    workdir: Path
    sites: int = 4
    rounds: int = 8
    heads: str = "6:2"
    preset: str = "small"
    records_per_site: int = 240
    data: list[list[Path]] = field(default_factory=list)  # real data: the source folders of each site
    optimizer: str = "adam"
    lr: float = 1e-3
    algorithm: str = "fedavg"  # any installed `cardiofl.algorithms` entry point, a plug-in's too
    algorithm_params: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    max_steps: int | None = None
    seed: int = 0
    database_url: str | None = None  # default: a SQLite file in the workdir
    port: int | None = None
    keep_running: bool = False
    deadline_s: float = 900.0
    min_records: int = 20  # the study's privacy.min_records: pooled statistics only from this many test records
    secure: bool = False  # secure aggregation (SecAgg+): the coordinator sees only masked updates and their sum
    # with `secure`, client-level DP too: each site clips its update to clip_norm, puts it on the grid and
    # adds its share of the discrete Gaussian noise (std noise_multiplier * Delta on the sum, Delta the
    # rounded clipping norm); 0 turns DP off. z = 1 prints an epsilon worth reading (replace-one: about
    # 41.6 after 8 rounds at delta 1e-5); a smaller z is as exact, and spends far more
    noise_multiplier: float = 1.0
    clip_norm: float = 0.1
    survey: bool = True  # a data-readiness survey study of every site first, its table printed
    validation_sites: int = 1  # the last sites are held out of training and validate each released model
    buffer_size: int = 0  # > 0: a buffered asynchronous study (FedBuff) releasing a version per M updates
    max_staleness: int = 8  # with buffer_size: an update more versions behind is refused
    slowdown: float = 1.0  # the last training site's agent trains this many times slower (a slow hospital)


def held_out(plan: DemoPlan, sites: list[str]) -> tuple[list[str], list[str]]:
    """(training sites, validation sites): the last `plan.validation_sites` are held out, one site always trains."""
    held = min(plan.validation_sites, len(sites) - 1)
    return sites[: len(sites) - held], sites[len(sites) - held :]


def study_config(plan: DemoPlan, sites: list[str]) -> dict[str, Any]:
    """The demo's FedDualAtt study: its training sites, and the held-out ones validating each released model."""
    training_sites, validation_sites = held_out(plan, sites)
    training: dict[str, Any] = {
        "optimizer": plan.optimizer,
        "lr": plan.lr,
        "batch_size": plan.batch_size,
        "local_epochs": 1,
    }
    if plan.max_steps is not None:
        training["max_steps"] = plan.max_steps
    config: dict[str, Any] = {
        "model": {"preset": plan.preset, "heads": plan.heads},
        "training": training,
        "algorithm": {"name": plan.algorithm, "params": plan.algorithm_params},
        "aggregation": {"name": "equal" if _dp(plan) else "samples"},  # DP-FedAvg weighs every site alike
        "rounds": plan.rounds,
        "min_sites": min(len(training_sites), plan.buffer_size or len(training_sites)),
        "round_deadline_s": plan.deadline_s,
        "seed": plan.seed,
        "privacy": _privacy(plan),
        "sites": training_sites,
    }
    if validation_sites:
        config["validation_sites"] = validation_sites
    if plan.buffer_size:
        config["buffered"] = {"buffer_size": plan.buffer_size, "max_staleness": plan.max_staleness}
    return config


def slow_site(plan: DemoPlan, sites: list[str]) -> str | None:
    """The training site whose agent the demo slows down (`plan.slowdown`), if any: the last one."""
    return held_out(plan, sites)[0][-1] if plan.slowdown > 1 else None


def title(plan: DemoPlan) -> str:
    """The study's name: FedDualAtt and its split, or the model and algorithm it runs instead."""
    if plan.algorithm == "fedavg" and plan.heads != "-":
        return f"FedDualAtt {plan.heads}"
    return f"{plan.preset} {plan.algorithm}"


def _dp(plan: DemoPlan) -> bool:
    return plan.secure and plan.noise_multiplier > 0


def _privacy(plan: DemoPlan) -> dict[str, Any]:
    """The study's privacy section: the minimum of records; with --secure, SecAgg+ and distributed DP."""
    privacy: dict[str, Any] = {"min_records": plan.min_records}
    if plan.secure:
        privacy["secure_aggregation"] = {}
    if _dp(plan):
        privacy["dp"] = {"noise_multiplier": plan.noise_multiplier, "clip_norm": plan.clip_norm, "mode": "distributed"}
    return privacy
