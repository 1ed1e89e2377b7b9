"""A study's model card, built from the views the API serves: every figure on it is the rounds API's."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.errors import Unprocessable
from coordinator.models import Round, RoundKind, RoundStatus, Site, SiteApproval, Study, Update
from coordinator.sites.approvals import study_digest
from coordinator.studies.card_limits import LOCAL_ALGORITHM, limitations
from coordinator.studies.card_reports import card_data, card_external, pick_survey
from coordinator.studies.views import evaluator_round, global_models, rounds_view, study_view
from shared.evaluation.calibration import binned_calibration
from shared.evaluation.metrics import EvalStats, parse_contribution
from shared.release import release_version
from shared.terms import StudyTerms
from shared.wire.api import RoundPublic
from shared.wire.card import (
    CardApproval,
    CardBaseline,
    CardPlugin,
    CardSite,
    ModelCard,
    ReliabilityBin,
    terms_digest,
)
from shared.wire.metrics import MetricSummary
from shared.wire.protocol import PROTOCOL_VERSION

__all__ = ["evaluated_round", "model_card"]


def _trained(rounds: Sequence[RoundPublic]) -> list[RoundPublic]:
    return [r for r in rounds if r.kind == RoundKind.TRAIN and r.status == RoundStatus.COMPLETED]


def evaluated_round(rounds: Sequence[RoundPublic]) -> RoundPublic | None:
    """The newest completed training round whose view has a pooled global reading; else the newest completed one.

    Round T's reading is the final evaluation's (round T + 1 evaluates theta^g_T); a running study's is
    that of the newest theta^g_t the next round's sites evaluated.
    """
    trained = _trained(rounds)
    read = [r for r in trained if r.pooled is not None and r.pooled.eval is not None]
    shown = read or trained
    return shown[-1] if shown else None


def _final(rounds: Sequence[RoundPublic], evaluated: RoundPublic | None, terms: StudyTerms) -> bool:
    """Whether the figures are the final evaluation's: of round T, read by a completed evaluation round."""
    done = any(r.kind == RoundKind.EVALUATE and r.status == RoundStatus.COMPLETED for r in rounds)
    return done and evaluated is not None and evaluated.number == terms.rounds


def _plugins(terms: StudyTerms) -> list[CardPlugin]:
    return [
        CardPlugin(role="model", name=terms.model.preset, identity=terms.model.plugin),
        CardPlugin(role="algorithm", name=terms.algorithm.name, identity=terms.algorithm.plugin),
    ]


def _approvals(session: Session, study: Study, states: dict[str, str]) -> list[CardApproval]:
    """Each listed site's last report: state, digest and time, and whether it approved the current terms."""
    rows = session.execute(
        select(Site.name, SiteApproval)
        .join(SiteApproval, SiteApproval.site_id == Site.id)
        .where(SiteApproval.study_id == study.id)
    ).all()
    reports = dict(rows)
    approvals = []
    for site in study.terms.sites:
        report, expected = reports.get(site), study_digest(study, site)
        approvals.append(
            CardApproval(
                site=site,
                state=states.get(site, "not reported"),
                digest=report.digest if report is not None else None,
                reported_at=report.reported_at if report is not None else None,
                expected_digest=expected,
                current=report is not None and report.state == "approved" and report.digest == expected,
            )
        )
    return approvals


def _sites(names: Sequence[str], evaluated: RoundPublic | None) -> list[CardSite]:
    by_site = {u.site: u for u in evaluated.updates} if evaluated is not None else {}
    cards = []
    for name in names:
        update = by_site.get(name)
        cards.append(
            CardSite(
                site=name,
                reported=update is not None,
                num_examples=update.num_examples if update is not None else None,
                eval=update.eval if update is not None else None,
                local_eval=update.local_eval if update is not None else None,
            )
        )
    return cards


def _reliability(session: Session, round_id: int) -> list[ReliabilityBin] | None:
    """The pooled reliability diagram of the round's theta^g_t from the evaluating sites' histograms (None: none)."""
    round_ = session.get(Round, round_id)
    evaluator = evaluator_round(session, round_) if round_ is not None else None
    if evaluator is None:
        return None
    reported = session.scalars(select(Update.metrics).where(Update.round_id == evaluator.id))
    stats = [parse_contribution(m["eval_stats"]) for m in reported if m.get("eval_stats") is not None]
    pooled = [s for s in stats if s is not None]
    if not pooled:
        return None  # none sent in the clear (a secure round sums them under masks), or too few records everywhere
    total: EvalStats = sum(pooled[1:], pooled[0])
    return [ReliabilityBin.model_validate(row) for row in binned_calibration(total.pos_hist, total.neg_hist).rows()]


def _baseline(
    session: Session, baseline: Study, terms: StudyTerms
) -> tuple[CardBaseline, dict[str, MetricSummary | None]]:
    """The baseline study's header, and each site's own model alone after its last completed training round.

    422 unless it is a `local` study of the same sites on the same labels (`baseline_not_local`,
    `baseline_not_comparable`): its figures would not answer what these sites gain.
    """
    if baseline.terms.algorithm.name != LOCAL_ALGORITHM:
        raise Unprocessable(
            f"study {baseline.id} runs algorithm {baseline.terms.algorithm.name}, not local: it is no local baseline",
            code="baseline_not_local",
        )
    if set(baseline.terms.sites) != set(terms.sites) or baseline.terms.labels != terms.labels:
        raise Unprocessable(
            f"study {baseline.id} trains on sites {sorted(baseline.terms.sites)} and {len(baseline.terms.labels)} "
            f"labels; this study on {sorted(terms.sites)} and {len(terms.labels)}: a baseline has the same of both",
            code="baseline_not_comparable",
        )
    trained = _trained(rounds_view(session, baseline))
    last = trained[-1] if trained else None
    alone = {u.site: u.local_eval for u in last.updates} if last is not None else {}
    header = CardBaseline(
        study_id=baseline.id, name=baseline.name, status=baseline.status, round=last.number if last else None
    )
    return header, alone


def model_card(
    session: Session, study: Study, now: datetime, baseline: Study | None = None, survey: Study | None = None
) -> ModelCard:
    """The study's model card as of `now`, compared with a `local` study on the same sites if given.

    With validation sites, their figures of the final theta^g; with a survey study of the training sites
    (`survey`, else the newest of them: coordinator/studies/card_reports.py), what it says of their data.
    """
    picked = pick_survey(session, study, survey)
    view = study_view(session, study)
    rounds = rounds_view(session, study)
    terms = study.terms
    evaluated = evaluated_round(rounds)
    sites = _sites(terms.sites, evaluated)
    compared = None
    if baseline is not None:
        compared, alone = _baseline(session, baseline, terms)
        sites = [site.model_copy(update={"baseline": alone.get(site.site)}) for site in sites]
    pooled = evaluated.pooled if evaluated is not None else None
    approvals = _approvals(session, study, view.approvals)
    final = _final(rounds, evaluated, terms)
    return ModelCard(
        study_id=study.id,
        uid=study.uid,
        name=study.name,
        status=study.status,
        created_by=study.created_by,
        created_at=study.created_at,
        generated_at=now,
        release=release_version(),
        protocol=PROTOCOL_VERSION,
        terms=terms,
        terms_digest=terms_digest(terms),
        plugins=_plugins(terms),
        approvals=approvals,
        completed_rounds=view.completed_rounds,
        evaluated_round=evaluated.number if evaluated is not None else None,
        final=final,
        global_label=pooled.global_label if pooled is not None else None,
        sites=sites,
        pooled_eval=pooled.eval if pooled is not None else None,
        pooled_local_eval=pooled.local_eval if pooled is not None else None,
        reliability=_reliability(session, evaluated.id) if evaluated is not None else None,
        baseline=compared,
        privacy=view.privacy,
        models=global_models(session, study.id),
        limitations=limitations(study.status, terms, rounds, evaluated, approvals, final=final),
        external=card_external(session, study),
        data=card_data(session, study, *picked) if picked is not None else None,
    )
