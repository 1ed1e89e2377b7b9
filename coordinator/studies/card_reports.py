"""A model card's parts from the sites' job reports (site_reports): its external validation, and its data survey.

External validation: the study's validation sites evaluated released theta^g_t with phi_0 on all their
records. The card shows theta^g_T, the final model (the last one stored once the study completed), once
any validation site reported it; before that the newest theta^g_t any validation site evaluated, and
says it is not the final one.

Data: a survey study's released surveys of the card's training sites, pooled (shared/evaluation/survey.py).
The survey is the one `?survey=` names (a survey study listing every training site, else 422), or by
default the newest survey study (highest id) that lists every training site and holds the survey of
each of them; a survey study's own card shows its own survey. Only the training sites' surveys are
pooled: a survey of more sites says nothing of the others here.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.errors import Unprocessable
from coordinator.models import GlobalModel, Site, SiteReport, Study, StudyStatus
from shared.evaluation.survey import PooledCount, pool
from shared.study.survey import survey_epsilon
from shared.wire.card import CardCount, CardData, CardDataRow, CardExternal, CardExternalSite
from shared.wire.jobs import JobKind, JobReport
from shared.wire.metrics import MetricSummary
from shared.wire.survey import GROUPS, QUALITY_FLAGS, TABLES, SiteSurvey, all_cells

__all__ = ["TOP_LABELS", "Chosen", "card_data", "card_external", "pick_survey"]

TOP_LABELS = 5  # the most frequent labels the Data section lists
KEPT = ("train", "test")  # the records a site's loader keeps: those its models see
LABELS = next(table.keys for table in TABLES if table.name == "labels")  # the survey's label vocabulary
CELLS = frozenset(all_cells())
Chosen = Literal["named", "latest", "self"]
Cells = dict[str, dict[tuple[str, str, str], int | None]]  # site -> its released counts by cell (None: suppressed)


def _reports(session: Session, study_id: int, kind: JobKind) -> list[tuple[str, int, JobReport, datetime]]:
    """(site, round, report, received) of the study's stored reports of `kind`."""
    rows = session.execute(
        select(Site.name, SiteReport)
        .join(Site, Site.id == SiteReport.site_id)
        .where(SiteReport.study_id == study_id, SiteReport.kind == kind.value)
        .order_by(SiteReport.round_number, SiteReport.id)
    ).all()
    return [(name, row.round_number, JobReport.model_validate(row.body), row.received_at) for name, row in rows]


def card_external(session: Session, study: Study) -> CardExternal | None:
    """The validation sites' figures of the final theta^g_T (else of the newest evaluated); None without any."""
    terms = study.terms
    if not terms.validation_sites:
        return None
    reports = _reports(session, study.id, JobKind.EXTERNAL)
    rounds = sorted({t for _, t, _, _ in reports})
    last = None  # T: the study's last released theta^g, once it completed
    if study.status == StudyStatus.COMPLETED:
        last = session.scalar(select(func.max(GlobalModel.round_number)).where(GlobalModel.study_id == study.id))
    shown = last if last in rounds else (rounds[-1] if rounds else None)
    at_round = {site: (report, at) for site, t, report, at in reports if t == shown}
    sites = []
    for site in terms.validation_sites:
        report, received = at_round.get(site, (None, None))
        evaluation = report.evaluation if report is not None else None
        summary = None if evaluation is None else MetricSummary.model_validate(evaluation.model_dump(mode="json"))
        sites.append(CardExternalSite(site=site, eval=summary, received_at=received))
    return CardExternal(
        validation_sites=list(terms.validation_sites),
        every=terms.validation_every,
        round=shown,
        final=shown is not None and shown == last,
        rounds=rounds,
        sites=sites,
    )


def _lists_every(survey: Study, sites: Sequence[str]) -> bool:
    return survey.terms.kind == "survey" and set(sites) <= set(survey.terms.sites)


def pick_survey(session: Session, study: Study, named: Study | None) -> tuple[Study, Chosen] | None:
    """The survey study the card's Data section reads, and how it was chosen; None where there is none.

    422 `survey_not_survey` when the named study is not a survey, `survey_not_comparable` when it does
    not list every training site of the card's study.
    """
    sites = study.terms.sites
    if named is not None:
        if named.terms.kind != "survey":
            raise Unprocessable(
                f"study {named.id} is a {named.terms.kind} study, not a survey", code="survey_not_survey"
            )
        if not _lists_every(named, sites):
            raise Unprocessable(
                f"study {named.id} surveys sites {sorted(named.terms.sites)}; the card's study trains on "
                f"{sorted(sites)}: a survey of its data lists every one of them",
                code="survey_not_comparable",
            )
        return named, "named"
    if study.terms.kind == "survey":
        return study, "self"
    site_ids = select(Site.id).where(Site.name.in_(sites))
    candidates = session.scalars(
        select(SiteReport.study_id)
        .where(SiteReport.kind == JobKind.SURVEY.value, SiteReport.site_id.in_(site_ids))
        .group_by(SiteReport.study_id)
        .having(func.count(func.distinct(SiteReport.site_id)) == len(set(sites)))
        .order_by(SiteReport.study_id.desc())
    )
    for candidate_id in candidates:
        candidate = session.get(Study, candidate_id)
        if candidate is not None and _lists_every(candidate, sites):
            return candidate, "latest"
    return None


def _count(pooled: PooledCount) -> CardCount:
    return CardCount(shown=pooled.shown, hidden=pooled.hidden, text=pooled.text())


def _row(cells: Cells, groups: Sequence[str], table: str, key: str) -> CardDataRow:
    """The (table, key) cells of `groups`, pooled per site and over all sites."""
    wanted = [(group, table, key) for group in groups if (group, table, key) in CELLS]
    per_site = {site: pool(counts[cell] for cell in wanted) for site, counts in cells.items()}
    pooled = pool(counts[cell] for counts in cells.values() for cell in wanted)
    return CardDataRow(key=key, sites={site: _count(c) for site, c in per_site.items()}, pooled=_count(pooled))


def _labels(cells: Cells) -> list[CardDataRow]:
    """The TOP_LABELS labels with the most kept records shown, each with its prevalence where the records are exact.

    With some of a label's counts suppressed its shown sum, and so its prevalence, is a lower bound.
    """
    records = pool(counts[(group, "records", "records")] for counts in cells.values() for group in KEPT)
    rows = [_row(cells, KEPT, "labels", label) for label in LABELS]
    shown = sorted((row for row in rows if row.pooled.shown > 0), key=lambda row: -row.pooled.shown)[:TOP_LABELS]
    if not records.exact or records.shown == 0:
        return shown
    return [row.model_copy(update={"prevalence": row.pooled.shown / records.shown}) for row in shown]


def card_data(session: Session, study: Study, survey: Study, chosen: Chosen) -> CardData:
    """The Data section's figures: the training sites' released surveys of `survey`, pooled."""
    reported: dict[str, SiteSurvey] = {
        site: report.survey for site, _, report, _ in _reports(session, survey.id, JobKind.SURVEY) if report.survey
    }
    sites = [site for site in study.terms.sites if site in reported]
    cells: Cells = {site: reported[site].cells() for site in sites}
    spec = survey.terms.survey
    sigma = spec.noise_sigma if spec is not None else None
    delta = spec.delta if spec is not None and sigma is not None else None
    return CardData(
        study_id=survey.id,
        name=survey.name,
        status=survey.status,
        chosen=chosen,
        sites=sites,
        awaiting=[site for site in study.terms.sites if site not in reported],
        min_records=survey.terms.privacy.min_records,
        noise_sigma=sigma,
        epsilon=survey_epsilon(sigma, delta) if sigma is not None and delta is not None else None,
        delta=delta,
        records=[_row(cells, (group,), "records", "records").model_copy(update={"key": group}) for group in GROUPS]
        if cells
        else [],
        labels=_labels(cells) if cells else [],
        quality=[_row(cells, GROUPS, "quality", flag) for flag in QUALITY_FLAGS] if cells else [],
        suppressed={site: sum(value is None for value in counts.values()) for site, counts in cells.items()},
        counts=len(all_cells()),
    )
