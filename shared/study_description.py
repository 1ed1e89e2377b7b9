"""What a study would run on a site's data and what would leave the site, and the digest a site approves.

The site builds the description itself from the study's config (its tasks carry the whole of it,
protocol 3) with this module's code, so the coordinator cannot vouch for a digest: it can only
send the config, and the site derives what that config would run and upload.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict

from shared.metrics import N_BINS
from shared.protocol import (
    AggregationSpec,
    AlgorithmSpec,
    ModelSpec,
    ParticipationSpec,
    PrivacyConfig,
    StudyOffer,
    TaskSpec,
    TrainingConfig,
)
from shared.study import algorithm_exchange

__all__ = ["StudyDescription", "UploadedTensor", "describe", "describe_study"]

DESCRIPTION_FORMAT = 1  # a change of what the description says changes every digest: sites approve again


class UploadedTensor(BaseModel):
    """One tensor every upload of the study carries."""

    model_config = ConfigDict(frozen=True)

    name: str
    shape: tuple[int, ...]
    dtype: str


class StudyDescription(BaseModel):
    """Everything a site's operator approves: the study's identity, what it runs, and what leaves the site."""

    model_config = ConfigDict(frozen=True)

    format: int = DESCRIPTION_FORMAT
    protocol: int  # the cardiofl protocol version of the study's tasks
    study_uid: str
    model: ModelSpec
    global_heads: int  # H_g: heads per attention block that are averaged across sites (this site's own split)
    local_heads: int  # H_l: heads that never leave the site (with per-site splits, uploaded as zeros)
    algorithm: AlgorithmSpec
    aggregation: AggregationSpec
    training: TrainingConfig
    participation: ParticipationSpec
    rounds: int
    seed: int
    keep_updates: bool  # the coordinator keeps each site's uploaded tensors after aggregation
    min_sites: int  # the quorum: no round's model is released from fewer sites' updates
    privacy: PrivacyConfig
    uploads: tuple[UploadedTensor, ...]  # exactly the tensors of every upload
    upload_values: int  # how many numbers those tensors hold
    upload_bytes: int  # and their size
    kept_local: tuple[str, ...]  # model and algorithm state that never leaves the site
    statistics: tuple[str, ...]  # every other number an upload carries, in words

    def digest(self) -> str:
        """sha256 of the description's canonical JSON: what `cardiofl site approve` records."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _statistics(aggregation: AggregationSpec, privacy: PrivacyConfig) -> tuple[str, ...]:
    """The numbers besides tensors that every upload of such a study carries."""
    said = [
        "n_k: the number of the site's training records",
        "the round's mean training loss, its number of steps, samples per second and training seconds",
        "the site's own model on its test split: loss, micro-F1, mAP (all classes and present classes) and the "
        "number of test records (scalars)",
        "the global model on the site's test split, for the pooled Global metrics: per-class TP/FP/FN counts "
        f"and {N_BINS}-bin score histograms, sent only from at least {privacy.min_records} test records",
    ]
    if privacy.secure_aggregation is not None:
        said.append(
            "under secure aggregation the tensors, counts and histograms leave only masked (SecAgg+): the "
            "coordinator learns their sum over the sites, never one site's"
        )
    if aggregation.name == "uncertainty":
        share = aggregation.params.get("validation_fraction")
        said.append(
            "H_k: the mean MC-dropout predictive entropy of the site's model on a validation carve of "
            f"{share:.0%} of its training records (one scalar); n_k counts the records it trained on"
        )
    return tuple(said)


def describe(
    *,
    protocol: int,
    study_uid: str,
    model: ModelSpec,
    algorithm: AlgorithmSpec,
    aggregation: AggregationSpec,
    training: TrainingConfig,
    participation: ParticipationSpec,
    rounds: int,
    seed: int,
    keep_updates: bool,
    privacy: PrivacyConfig,
    min_sites: int,
    site: str = "",
) -> StudyDescription:
    """The description of a study with these settings, derived from the study rules of this cardiofl.

    `site` is the describing site: with per-site head splits (model.site_heads) the heads it shares
    and keeps are its own split's.
    """
    exchange = algorithm_exchange(model, algorithm)
    uploads = tuple(
        UploadedTensor(name=name, shape=spec.shape, dtype=str(spec.dtype).removeprefix("torch."))
        for name, spec in exchange.upload_schema().items()
    )
    config = model.for_site(site).config()
    return StudyDescription(
        protocol=protocol,
        study_uid=study_uid,
        model=model,
        global_heads=config.n_global_heads,
        local_heads=config.n_local_heads,
        algorithm=algorithm,
        aggregation=aggregation,
        training=training,
        participation=participation,
        rounds=rounds,
        seed=seed,
        keep_updates=keep_updates,
        min_sites=min_sites,
        privacy=privacy,
        uploads=uploads,
        upload_values=sum(spec.numel for spec in exchange.upload_schema().values()),
        upload_bytes=sum(spec.numel * spec.dtype.itemsize for spec in exchange.upload_schema().values()),
        kept_local=tuple(sorted(exchange.local_names())),
        statistics=_statistics(aggregation, privacy),
    )


def describe_study(source: TaskSpec | StudyOffer, site: str = "") -> StudyDescription:
    """The description of the study of a task or an offer, as `site` would run it (both carry the same names)."""
    return describe(**{name: getattr(source, name) for name in _INPUTS}, site=site)


_INPUTS = (
    "protocol",
    "study_uid",
    "model",
    "algorithm",
    "aggregation",
    "training",
    "participation",
    "rounds",
    "seed",
    "keep_updates",
    "privacy",
    "min_sites",
)
