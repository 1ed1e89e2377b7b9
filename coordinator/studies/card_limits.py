"""A model card's known limitations: what the rounds API shows that a reader of its figures must keep in mind."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.models import RoundStatus
from coordinator.rounds.plain import QUORUM_MISSED
from shared.terms import StudyTerms
from shared.wire.api import RoundPublic
from shared.wire.card import CardApproval, CardLimitation

__all__ = ["LOCAL_ALGORITHM", "limitations", "sites_below_min_records"]

LOCAL_ALGORITHM = "local"  # each site trains alone: the baseline a card compares with


def sites_below_min_records(rounds: Sequence[RoundPublic], min_records: int) -> dict[str, int | None]:
    """Site -> its test records (None when unknown) of every site any round shows below `min_records`.

    Such a site sends `{"too_few_records": true}` instead of counts and histograms, and FedCVD's
    scalars of its own model without clinical figures.
    """
    found: dict[str, int | None] = {}
    for round_ in rounds:
        for update in round_.updates:
            records = update.local_eval.n_samples if update.local_eval is not None else None
            marked = update.eval is not None and update.eval.too_few_records is True
            below = records is not None and records < min_records
            if marked or below:
                found[update.site] = records if below else found.get(update.site)
    return dict(sorted(found.items()))


def _too_few(rounds: Sequence[RoundPublic], min_records: int) -> list[CardLimitation]:
    return [
        CardLimitation(
            kind="too_few_records",
            site=site,
            text=f"site {site} has fewer test records{'' if records is None else f' ({records})'} than the study's "
            f"privacy.min_records ({min_records}): it reports no clinical figures, and its records are not in the "
            "pooled global figures",
        )
        for site, records in sites_below_min_records(rounds, min_records).items()
    ]


def _failed(rounds: Sequence[RoundPublic]) -> list[CardLimitation]:
    return [
        CardLimitation(
            kind="quorum_missed" if (r.note or "").startswith(QUORUM_MISSED) else "round_failed",
            round=r.number,
            attempt=r.attempt,
            text=f"round {r.number} (attempt {r.attempt}) failed: {r.note or 'no reason recorded'}",
        )
        for r in rounds
        if r.status == RoundStatus.FAILED
    ]


def _reading(status: str, terms: StudyTerms, evaluated: RoundPublic | None, final: bool) -> list[CardLimitation]:
    """Whether the figures are the final evaluation's, and whether a global model was evaluated at all."""
    if evaluated is None:
        return [CardLimitation(kind="no_global_reading", text=f"the study is {status}: no round has completed yet")]
    said = []
    if not final:
        said.append(
            CardLimitation(
                kind="not_final",
                round=evaluated.number,
                text=f"the study is {status}: the figures are of round {evaluated.number} of {terms.rounds}, not the "
                "final evaluation of the last global model",
            )
        )
    if evaluated.pooled is None or evaluated.pooled.eval is None:
        said.append(
            CardLimitation(
                kind="no_global_reading",
                round=evaluated.number,
                text=f"no site has evaluated the global model of round {evaluated.number} yet: only the sites' own "
                "models have figures",
            )
        )
    return said


def _absent(terms: StudyTerms, evaluated: RoundPublic | None) -> list[CardLimitation]:
    if evaluated is None:
        return []
    reported = {u.site for u in evaluated.updates}
    return [
        CardLimitation(
            kind="not_reported",
            site=site,
            round=evaluated.number,
            text=f"site {site} has no update in round {evaluated.number}: it has no figures on this card",
        )
        for site in terms.sites
        if site not in reported
    ]


def _unapproved(approvals: Sequence[CardApproval]) -> list[CardLimitation]:
    return [
        CardLimitation(
            kind="not_approved",
            site=a.site,
            text=f"site {a.site}'s operator has not approved the study's current terms ({a.state})",
        )
        for a in approvals
        if not a.current
    ]


def _by_terms(terms: StudyTerms) -> list[CardLimitation]:
    said = []
    if terms.privacy.secure_aggregation is not None:
        said.append(
            CardLimitation(
                kind="summed_statistics",
                text="secure aggregation: the sites' counts and histograms are summed under masks, so there are no "
                "per-site figures of the global model and no reliability diagram",
            )
        )
    if terms.algorithm.name == LOCAL_ALGORITHM:
        said.append(
            CardLimitation(
                kind="local_only",
                text="algorithm local: each site trains alone and nothing is shared, so there is no global model; "
                "the pooled figures are those of the sites' own models over their test records",
            )
        )
    return said


def limitations(
    status: str,
    terms: StudyTerms,
    rounds: Sequence[RoundPublic],
    evaluated: RoundPublic | None,
    approvals: Sequence[CardApproval],
    *,
    final: bool,
) -> list[CardLimitation]:
    """Every limitation of a card of these rounds, in a fixed order: sites, rounds, the reading, the terms."""
    return [
        *_too_few(rounds, terms.privacy.min_records),
        *_failed(rounds),
        *_reading(status, terms, evaluated, final),
        *_absent(terms, evaluated),
        *_unapproved(approvals),
        *_by_terms(terms),
    ]
