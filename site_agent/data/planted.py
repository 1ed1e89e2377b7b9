"""Planted-truth sites: labels from a teacher FedDualAtt whose global heads all sites share, its local heads per site.

The teacher is the gated model of learned head assignment (shared/model/network.py, `learned_heads`) with
hard gates: at site k its last H_l^(k) heads of every block are local (gate 1), drawn per site, and
the others global (gate 0), the same at every site, as is everything else (backbone, W_c, FFN,
classifier). Signals are, per lead, a random level and drift plus a little white noise, drawn alike
at every site (a random network's output barely varies over white noise alone), so the sites
differ only in their planted local heads: each site's split is known by construction. With
`sources` set, the levels and drifts are those of that many latent sources, mixed into the leads
by one fixed matrix: a lower-dimensional input, which a student learns from fewer records. (Whether it is
also the site's best fixed split depends on the other sites: under one split for all, a site with
more local heads than the split pulls the shared heads toward its own; docs/researcher/experiments.md.)
`gain` scales both branches' W_in and W_out so that the heads, not the backbone alone, decide the
labels. Class c is positive where the teacher's logit is above the site's `prevalence` quantile of
c's logits (a site's local heads also shift its logits as a whole; the threshold follows them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from shared.algorithms.learned_heads import FROZEN_LOGIT, gate_names
from shared.model.network import ModelConfig, build_model
from site_agent.data.loader import SiteData, SplitArrays
from site_agent.data.report import LoadReport, SourceReport

__all__ = ["PlantedSpec", "planted_sites", "teacher_logits"]

_PER_HEAD = ("in_proj.weight", "in_proj.bias", "out_proj.weight")  # W_out's bias is the branch's, not a head's
_WEIGHTS = ("in_proj.weight", "out_proj.weight")
_GLOBAL, _SIGNALS, _MIXING = 0, 1, 1 << 20  # random streams; site k's local heads: 2 + k


def _seed(spec_seed: int, stream: int) -> int:
    """A 63-bit seed of one random stream of the planted data."""
    return int(np.random.SeedSequence([spec_seed, 33, stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))


class PlantedSpec(BaseModel):
    """The planted truth: each site's local heads H_l^(k), its records, and the teacher's seed and gain."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    local_heads: tuple[int, ...] = Field(min_length=1)  # H_l^(k) per site: its planted split is H - H_l^(k) : H_l^(k)
    train_records: tuple[int, ...] = Field(min_length=1)  # per site: a small site pulls the shared heads less
    test_records: int = Field(400, ge=1)  # per site: many, so that a site's F1 is measured closely
    signal_len: int = Field(512, ge=64)  # samples per record (16 tokens): CPU-sized
    prevalence: float = Field(0.25, gt=0, lt=1)  # share of positives of each class at each site
    gain: float = Field(3.0, gt=0)  # scale of the teacher's attention projections
    sources: int | None = Field(None, ge=1)  # latent sources mixed into the leads; None: each lead its own
    seed: int = 0


def _teacher_state(config: ModelConfig, spec: PlantedSpec, site: int) -> dict[str, torch.Tensor]:
    """Site `site`'s teacher: shared tensors from the spec's seed, local heads drawn per site, hard gates.

    The local branch's W_out bias is not a head's: it stays the shared one, so that a site with no
    local head has exactly the shared teacher.
    """
    state = build_model(config, seed=_seed(spec.seed, _GLOBAL)).state_dict()
    own = build_model(config, seed=_seed(spec.seed, 2 + site)).state_dict()
    n_local = spec.local_heads[site]
    gate = torch.full((config.n_heads,), -FROZEN_LOGIT)
    gate[config.n_heads - n_local :] = FROZEN_LOGIT
    for block, name in enumerate(gate_names(config)):
        state[name] = gate.clone()
        for part in _PER_HEAD:
            state[f"blocks.{block}.local_branch.{part}"] = own[f"blocks.{block}.local_branch.{part}"]
        for part in _WEIGHTS:
            for branch in ("global_branch", "local_branch"):
                state[f"blocks.{block}.{branch}.{part}"] = state[f"blocks.{block}.{branch}.{part}"] * spec.gain
    return state


def teacher_logits(config: ModelConfig, spec: PlantedSpec, site: int, signals: torch.Tensor) -> torch.Tensor:
    """The teacher's logits (N, n_classes) at site `site` (eval mode: no dropout)."""
    gated = replace(config, learned_heads=True)
    if not 0 <= spec.local_heads[site] <= gated.n_heads:
        raise ValueError(f"site {site}: H_l must be in 0..{gated.n_heads}, got {spec.local_heads[site]}")
    model = build_model(gated, seed=0)
    model.load_state_dict(_teacher_state(gated, spec, site))
    model.eval()
    with torch.no_grad():
        return torch.cat([model(chunk) for chunk in torch.split(signals, 256)])


def _signals(n: int, leads: int, length: int, generator: torch.Generator, mixing: torch.Tensor | None) -> torch.Tensor:
    """(n, leads, length) records: per lead a level and a drift plus white noise of std 0.1.

    The levels and drifts are N(0, 1) per lead, or with `mixing` (leads, sources) its mix of that
    many N(0, 1) sources.
    """
    width = leads if mixing is None else mixing.shape[1]
    level = torch.randn(n, width, 1, generator=generator)
    drift = torch.randn(n, width, 1, generator=generator)
    if mixing is not None:
        level, drift = mixing @ level, mixing @ drift
    return level + drift * torch.linspace(-1.0, 1.0, length) + 0.1 * torch.randn(n, leads, length, generator=generator)


def _mixing(spec: PlantedSpec, leads: int) -> torch.Tensor | None:
    """The fixed (leads, sources) matrix of the spec's latent sources, scaled so that each lead has variance ~1."""
    if spec.sources is None:
        return None
    generator = torch.Generator().manual_seed(_seed(spec.seed, _MIXING))
    root: float = spec.sources**0.5
    return torch.randn(leads, spec.sources, generator=generator) / root


def _split(signals: np.ndarray, labels: np.ndarray, name: str, rows: np.ndarray) -> SplitArrays:
    return SplitArrays(signals[rows], labels[rows], tuple(f"{name}/p{row:05d}" for row in rows))


def _report(name: str, labels: np.ndarray, n_test: int) -> LoadReport:
    n = len(labels)
    source = SourceReport(name=name, kind="planted", path="", candidates=n, loaded=n, train=n - n_test, test=n_test)
    source.label_counts = labels.sum(axis=0).astype(int).tolist()
    return LoadReport([source])


def planted_sites(config: ModelConfig, spec: PlantedSpec, names: Sequence[str], cache_dir: Path) -> list[SiteData]:
    """The sites `names` (one per entry of spec.local_heads), generated in memory; the same spec, the same data."""
    if not len(names) == len(spec.local_heads) == len(spec.train_records):
        raise ValueError(
            f"got {len(names)} site names, {len(spec.local_heads)} local head counts and "
            f"{len(spec.train_records)} training sizes: give one of each per site"
        )
    generator = torch.Generator().manual_seed(_seed(spec.seed, _SIGNALS))
    n_test = spec.test_records
    mixing = _mixing(spec, config.n_leads)
    signals = [_signals(n_test + n, config.n_leads, spec.signal_len, generator, mixing) for n in spec.train_records]
    logits = [teacher_logits(config, spec, site, x) for site, x in enumerate(signals)]
    sites = []
    for name, x, z in zip(names, signals, logits, strict=True):
        labels = (z > torch.quantile(z, 1 - spec.prevalence, dim=0)).float().numpy()
        order = np.arange(len(x))
        train, test = order[n_test:], order[:n_test]
        data = x.numpy()
        sites.append(
            SiteData(
                train=_split(data, labels, name, train),
                test=_split(data, labels, name, test),
                report=_report(name, labels, n_test),
                cache_path=Path(cache_dir),
            )
        )
    return sites
