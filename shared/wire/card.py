"""A study's model card (GET /api/v1/studies/{id}/card): its terms, approvals, figures, epsilon and known limitations.

The coordinator builds it from the very views its other endpoints serve (coordinator/studies/card.py), so
every figure on it is the API's: a site's `eval` and `local_eval` and the pooled ones are those of the
evaluated round in GET /studies/{id}/rounds, epsilon is the study's `privacy`, the digests are those of
GET /studies/{id}/models. `external` is what the study's validation sites reported of theta^g (the site
reports GET /studies/{id}/external serves), `data` what a survey study of its sites released (those of
GET /studies/{id}/survey, pooled). `?format=md|html` renders the same card as text for people.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from shared.plugins import PluginIdentity
from shared.terms import StudyTerms
from shared.wire.api import GlobalModelPublic
from shared.wire.metrics import MetricSummary, PrivacySpent

__all__ = [
    "CARD_FORMATS",
    "CardApproval",
    "CardBaseline",
    "CardCount",
    "CardData",
    "CardDataRow",
    "CardExternal",
    "CardExternalSite",
    "CardFormat",
    "CardLimitation",
    "CardPlugin",
    "CardSite",
    "LimitationKind",
    "ModelCard",
    "ReliabilityBin",
    "terms_digest",
]

CardFormat = Literal["json", "md", "html"]
CARD_FORMATS: tuple[CardFormat, ...] = ("json", "md", "html")
LimitationKind = Literal[
    "too_few_records",  # a site's test split is below privacy.min_records: no clinical figures, not pooled
    "quorum_missed",  # a round attempt failed: fewer sites than min_sites reported by its deadline
    "round_failed",  # a round attempt failed otherwise (an aggregation or a secure phase that could not finish)
    "not_final",  # the figures are not those of the final evaluation of theta^g_T
    "no_global_reading",  # no site has evaluated a global model yet
    "not_reported",  # a site the study lists has no update in the evaluated round
    "not_approved",  # a site's operator has not approved the study's current terms
    "summed_statistics",  # secure aggregation: no site's global-model figures, no reliability diagram
    "local_only",  # algorithm `local`: nothing is shared, there is no theta^g
]


def terms_digest(terms: StudyTerms) -> str:
    """sha256 of the terms' canonical JSON (sorted keys, no spaces): one study's terms, one digest."""
    canonical = json.dumps(terms.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class CardPlugin(BaseModel):
    """A rule the terms name and who provides it: a plug-in's identity, or None for cardiofl's own."""

    role: Literal["model", "algorithm"]  # the rules a plug-in may provide (shared/plugins.py GROUPS)
    name: str  # the model preset or the algorithm
    identity: PluginIdentity | None


class CardApproval(BaseModel):
    """What a site last reported of the study: its state, the digest it approved and when."""

    site: str
    state: str  # approved / awaiting approval / not reported (as StudyPublic.approvals says)
    digest: str | None  # the description digest the site reported (None: it never reported)
    reported_at: datetime | None
    expected_digest: str  # the digest of the study's terms described for this site by this coordinator
    current: bool  # approved, of the expected digest


class CardSite(BaseModel):
    """One site's figures in the evaluated round, as GET /studies/{id}/rounds shows them, and its baseline."""

    site: str
    reported: bool  # whether it has an update in the evaluated round
    num_examples: int | None  # n_k, its training records
    eval: MetricSummary | None  # the global evaluation model on its test split (from its histograms)
    local_eval: MetricSummary | None  # its own model, exact at the site, with bootstrap intervals
    baseline: MetricSummary | None = None  # its model trained alone: the baseline study's `local_eval`


class CardBaseline(BaseModel):
    """The local baseline the card compares with: a study of algorithm `local` on the same sites."""

    study_id: int
    name: str
    status: str
    round: int | None  # the baseline's evaluated round (its last completed training round)


class ReliabilityBin(BaseModel):
    """One bin of the pooled reliability diagram (shared.evaluation.calibration.Reliability.rows)."""

    low: float
    high: float
    count: int
    observed: float | None  # fraction of positives among the bin's probabilities
    predicted: float | None  # their mean predicted probability (each at its histogram bin's midpoint)
    predicted_error: float  # |predicted - exact mean| <= this


class CardLimitation(BaseModel):
    """A known limitation of the card's figures, in words, with the site or round it concerns."""

    kind: LimitationKind
    text: str
    site: str | None = None
    round: int | None = None
    attempt: int | None = None


class CardExternalSite(BaseModel):
    """A validation site's evaluation of the card's theta^g_t with phi_0 on all its records (None: not reported)."""

    site: str
    eval: MetricSummary | None  # its exact report, with 95% bootstrap intervals
    received_at: datetime | None


class CardExternal(BaseModel):
    """External validation: a released theta^g at the study's validation sites, which never trained it."""

    validation_sites: list[str]
    every: int  # the terms' validation_every
    round: int | None  # t of the theta^g_t shown: T once a validation site evaluated it, else the newest evaluated
    final: bool  # t = T of a completed study
    rounds: list[int]  # every round some validation site evaluated
    sites: list[CardExternalSite]  # each validation site at `round`, in the terms' order


class CardCount(BaseModel):
    """A count pooled over sites as far as it shows (shared.evaluation.survey.PooledCount)."""

    shown: int  # the sum of the counts shown
    hidden: int  # how many pooled counts were suppressed: `shown` is then a lower bound
    text: str  # as written: "1,234", "≥1,234", or "–" (only suppressed counts, or shown ones all 0)


class CardDataRow(BaseModel):
    """One key of a survey's table, pooled per site and over the sites."""

    key: str
    sites: dict[str, CardCount]
    pooled: CardCount
    prevalence: float | None = None  # labels: pooled shown / pooled records, where the records are exact


class CardData(BaseModel):
    """What a survey study of the card's training sites says of their records: pooled counts, no per-record value."""

    study_id: int
    name: str
    status: str
    chosen: Literal["named", "latest", "self"]  # ?survey=, the newest survey of these sites, or the card's own
    sites: list[str]  # the training sites whose survey it pools, in the terms' order
    awaiting: list[str]  # the training sites that have not reported to it
    min_records: int  # counts below it were suppressed
    noise_sigma: float | None
    epsilon: float | None  # what the noise spent, at `delta`
    delta: float | None
    records: list[CardDataRow]  # per group: train, test, excluded
    labels: list[CardDataRow]  # the most frequent labels among the kept (train and test) records
    quality: list[CardDataRow]  # each quality flag, over every group
    suppressed: dict[str, int]  # per site: how many of its counts it suppressed
    counts: int  # how many counts one site's survey holds


class ModelCard(BaseModel):
    """A study's model card: what was agreed, by whom, what came of it, and what to keep in mind reading it."""

    study_id: int
    uid: str
    name: str
    status: str
    created_by: str
    created_at: datetime
    generated_at: datetime
    release: str  # the coordinator's cardiofl release
    protocol: int
    terms: StudyTerms
    terms_digest: str  # terms_digest(terms)
    plugins: list[CardPlugin]
    approvals: list[CardApproval]
    completed_rounds: int
    evaluated_round: int | None  # t: the figures are of theta^g_t (eval) and the sites' models after round t
    final: bool  # t = T and theta^g_T was evaluated in the final evaluation round
    global_label: str | None  # what the pooled `eval` model is (PooledMetrics.global_label)
    sites: list[CardSite]
    pooled_eval: MetricSummary | None
    pooled_local_eval: MetricSummary | None
    reliability: list[ReliabilityBin] | None  # of the pooled evaluation, from the sites' histograms
    baseline: CardBaseline | None = None
    privacy: PrivacySpent | None  # epsilon spent, under its neighbouring relation (None without DP)
    models: list[GlobalModelPublic]  # every stored theta^g_t and its digest
    limitations: list[CardLimitation]
    external: CardExternal | None = None  # with validation sites
    data: CardData | None = None  # with a survey study of the training sites
