"""What a study would run on a site's data and what would leave the site, and the digest a site approves.

The site builds the description itself from the study's terms (its offers and tasks carry them
whole) with this module's code, so the coordinator cannot vouch for a digest: it can only send the
terms, and the site derives what they would run and upload. The coordinator computes the same
digest to tell a current approval from an outdated one (coordinator/sites/approvals.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from shared.algorithms.exchange import Exchange
from shared.algorithms.registry import parsed_params
from shared.evaluation.metrics import N_BINS
from shared.study.rules import algorithm_exchange
from shared.study.survey import survey_epsilon
from shared.terms import AggregationSpec, PrivacyConfig, StudyTerms
from shared.wire.jobs import SiteJob
from shared.wire.protocol import StudyOffer, TaskSpec

__all__ = ["StudyDescription", "UploadedTensor", "describe", "describe_study", "terms_differences"]

DESCRIPTION_FORMAT = 2  # 2: the terms ride whole (shared/terms/study_terms.py), with the describing site's name


class UploadedTensor(BaseModel):
    """One tensor every upload of the study carries."""

    model_config = ConfigDict(frozen=True)

    name: str
    shape: tuple[int, ...]
    dtype: str


class StudyDescription(BaseModel):
    """Everything a site's operator approves: the study's identity, its terms, and what would leave the site.

    The digest covers the terms whole (every field that decides what runs on the site's data and
    what leaves it), the study's uid, the describing site and the protocol, and what this release
    derives from them (the tensors of every upload, what stays local, the statistics): a study whose
    terms change, or a release that would upload something else, has another digest.
    """

    model_config = ConfigDict(frozen=True)

    format: int = DESCRIPTION_FORMAT
    protocol: int  # the cardiofl protocol version of the study's tasks
    study_uid: str
    site: str  # the site this description is for (its own head split, its own digest)
    terms: StudyTerms
    global_heads: int  # H_g: heads per attention block that are averaged across sites (this site's own split)
    local_heads: int  # H_l: heads that never leave the site (with per-site splits, uploaded as zeros)
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
        f"only from at least {privacy.min_records} test records, the site's own model's clinical figures: "
        "macro-AUROC, balanced accuracy, sensitivity, specificity and ECE, the number of classes the macros "
        "average, and the two ends of 95% bootstrap intervals of these and of micro-F1 and mAP (scalars)",
        "the global model on the site's test split, for the pooled Global metrics: per-class TP/FP/FN counts "
        f"and {N_BINS}-bin score histograms, sent only from at least {privacy.min_records} test records",
    ]
    if privacy.secure_aggregation is not None:
        said.append(
            "under secure aggregation the tensors, counts and histograms leave only masked (SecAgg+): the "
            "coordinator learns their sum over the sites, never one site's"
        )
    if aggregation.name == "uncertainty":
        share = getattr(parsed_params(aggregation), "validation_fraction", 0.0)
        said.append(
            "H_k: the mean MC-dropout predictive entropy of the site's model on a validation carve of "
            f"{share:.0%} of its training records (one scalar); n_k counts the records it trained on"
        )
    return tuple(said)


def describe(terms: StudyTerms, *, study_uid: str, site: str, protocol: int) -> StudyDescription:
    """The description `site` approves of a study with these terms, derived by this cardiofl's study rules.

    With per-site head splits (model.site_heads) the heads it shares and keeps are its own split's. A
    survey, an evaluation, and a training study's validation site (its `validation_sites`) upload no
    tensor: their descriptions say what they send instead (shared/wire/jobs.py).
    """
    exchange = algorithm_exchange(terms.model, terms.algorithm)
    config = terms.model.for_site(site).config()
    kept = tuple(sorted(exchange.local_names()))
    if terms.kind == "survey":
        kept, statistics = (), _survey_statistics(terms)
    elif terms.kind == "evaluate":
        statistics = _evaluation_statistics(terms)
    elif site in terms.validation_sites:
        statistics = _validation_statistics(terms)
    else:
        return _training_description(terms, exchange, study_uid=study_uid, site=site, protocol=protocol)
    return StudyDescription(
        protocol=protocol,
        study_uid=study_uid,
        site=site,
        terms=terms,
        global_heads=config.n_global_heads,
        local_heads=config.n_local_heads,
        uploads=(),
        upload_values=0,
        upload_bytes=0,
        kept_local=kept,
        statistics=statistics,
    )


def _training_description(
    terms: StudyTerms, exchange: Exchange, *, study_uid: str, site: str, protocol: int
) -> StudyDescription:
    """What a training site of a training study approves: the tensors of every upload and the statistics beside them."""
    schema = exchange.upload_schema()
    uploads = tuple(
        UploadedTensor(name=name, shape=spec.shape, dtype=str(spec.dtype).removeprefix("torch."))
        for name, spec in schema.items()
    )
    config = terms.model.for_site(site).config()
    return StudyDescription(
        protocol=protocol,
        study_uid=study_uid,
        site=site,
        terms=terms,
        global_heads=config.n_global_heads,
        local_heads=config.n_local_heads,
        uploads=uploads,
        upload_values=sum(spec.numel for spec in schema.values()),
        upload_bytes=sum(spec.numel * spec.dtype.itemsize for spec in schema.values()),
        kept_local=tuple(sorted(exchange.local_names())),
        statistics=_statistics(terms.aggregation, terms.privacy) + _buffered_statistics(terms),
    )


def _buffered_statistics(terms: StudyTerms) -> tuple[str, ...]:
    """A buffered study: when an upload may be used, and what its staleness tells the coordinator."""
    if terms.buffered is None:
        return ()
    return (
        f"buffered (FedBuff): each upload is the site's model trained from the version it was given; it joins "
        f"the buffer open when it arrives, up to {terms.buffered.max_staleness} versions later, and its "
        "arrival time and the version it trained from are recorded",
    )


def _scalar_report(privacy: PrivacyConfig, records: str) -> list[str]:
    """The scalar evaluation a site sends of one model on `records` (the same as its own model's in a round)."""
    return [
        f"the model on {records}: loss, micro-F1, mAP (all classes and present classes) and the number of "
        "records (scalars)",
        f"only from at least {privacy.min_records} records, its clinical figures: macro-AUROC, balanced accuracy, "
        "sensitivity, specificity and ECE, the number of classes the macros average, and the two ends of 95% "
        "bootstrap intervals of these and of micro-F1 and mAP (scalars)",
    ]


def _survey_statistics(terms: StudyTerms) -> tuple[str, ...]:
    """What a survey study's site sends, once: its released survey, and nothing else."""
    survey = terms.survey
    said = [
        "once, nothing else: the site's data-readiness survey, counts of records by group (train, test, excluded "
        "by reason), of the 20 labels, sampling rates, durations, lead sets, signal-quality flags, age bands and "
        "sexes (docs/data-owner/survey.md); never a record, a signal or a per-record value",
        f"every count below {terms.privacy.min_records} records is suppressed, and so are counts from which one "
        "could be worked out",
    ]
    if survey is not None and survey.noise_sigma is not None:
        epsilon = survey_epsilon(survey.noise_sigma, survey.delta)
        said.append(
            f"before suppression each count carries discrete Gaussian noise of sigma {survey.noise_sigma:g}: "
            f"({epsilon:.3g}, {survey.delta:g})-differential privacy of the release, by record"
        )
    return tuple(said)


def _evaluation_statistics(terms: StudyTerms) -> tuple[str, ...]:
    """What an evaluate study's site sends: the named model evaluated on its test split, before and after adapting."""
    spec = terms.evaluation
    assert spec is not None  # an evaluate study's terms name it
    source = (
        f"the final model of study {spec.study_uid}"
        if spec.study_uid is not None
        else "the model whose digests the terms name, uploaded by the researcher"
    )
    said = [
        f"nothing is trained for others and no tensor leaves: the site downloads {source} "
        f"(theta^g {str(spec.model_sha256)[:12]}, phi_0 {str(spec.initial_local_sha256)[:12]})",
        *_scalar_report(terms.privacy, "the site's test split"),
    ]
    if spec.adapt_local_epochs:
        said.append(
            f"the same again after training only the model's local tensors (phi) for {spec.adapt_local_epochs} "
            "epoch(s) on the site's training split, and that split's number of records; the adapted phi stays here"
        )
    return tuple(said)


def _validation_statistics(terms: StudyTerms) -> tuple[str, ...]:
    """What a validation site sends: each released global model evaluated on all its records; it never trains."""
    every = "each" if terms.validation_every == 1 else f"every {terms.validation_every}th"
    return (
        f"this is a validation site: it never trains nor uploads a tensor; it evaluates {every} released global "
        "model (theta^g with phi_0) and the final one",
        *_scalar_report(terms.privacy, "all of the site's records (train and test splits)"),
    )


def describe_study(source: TaskSpec | StudyOffer | SiteJob, site: str) -> StudyDescription:
    """The description `site` approves of the study a task or an offer carries the terms of."""
    return describe(source.terms, study_uid=source.study_uid, site=site, protocol=source.protocol)


def terms_differences(first: StudyTerms, second: StudyTerms) -> list[str]:
    """The paths at which two studies' terms differ (`model.heads`, `privacy.secure_aggregation`), sorted."""
    return sorted(_differences(first.model_dump(mode="json"), second.model_dump(mode="json"), ""))


def _differences(first: Any, second: Any, path: str) -> list[str]:
    if isinstance(first, dict) and isinstance(second, dict):
        return [
            found
            for key in first.keys() | second.keys()
            for found in _differences(first.get(key), second.get(key), f"{path}.{key}" if path else str(key))
        ]
    return [] if first == second else [path or "(the terms)"]
