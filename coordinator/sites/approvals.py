"""Studies offered to a site, and what each site reports of its operator's approval of them.

An offer carries the study's terms whole; the site digests them with what they imply
(shared/study/description.py). An approval is taken only of the digest this coordinator computes
the same way for that site: an approval of other terms, or of another release's description, is
refused (409 approval_digest_mismatch), so a study's approvals always name its current terms.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.errors import Conflict, NotAParticipant
from coordinator.models import Site, SiteApproval, Study, StudyStatus
from coordinator.sites.security import Principal
from shared.study.description import describe
from shared.wire.protocol import PROTOCOL_VERSION, ApprovalReport, StudyOffer

__all__ = [
    "APPROVED",
    "AWAITING",
    "DECLINED",
    "NOT_REPORTED",
    "approval_states",
    "approved_study_ids",
    "offers",
    "report_approval",
    "study_digest",
]

APPROVED = "approved"
AWAITING = "awaiting approval"
DECLINED = "declined"  # the site's operator declined the study's description: the site takes none of its tasks
NOT_REPORTED = "not reported"  # the site has not said yet (its agent never polled since the study was created)
_SHOWN = {"approved": APPROVED, "awaiting_approval": AWAITING, "declined": DECLINED}
_OPEN = (StudyStatus.DRAFT, StudyStatus.RUNNING, StudyStatus.PAUSED)


def _listing(study: Study, site_name: str) -> bool:
    return site_name in study.terms.listed_sites


def _reports(session: Session, site_id: int) -> dict[int, SiteApproval]:
    rows = session.scalars(select(SiteApproval).where(SiteApproval.site_id == site_id))
    return {row.study_id: row for row in rows}


def offers(session: Session, site: Principal, *, finished: bool = False) -> list[StudyOffer]:
    """The studies that list `site`, oldest first: those not finished yet, or every one with `finished`."""
    assert site.site_id is not None and site.site_name is not None
    query = select(Study).order_by(Study.id)
    if not finished:
        query = query.where(Study.status.in_(_OPEN))
    reports = _reports(session, site.site_id)
    listed = []
    for study in session.scalars(query):
        if not _listing(study, site.site_name):
            continue
        report = reports.get(study.id)
        listed.append(
            StudyOffer(
                protocol=PROTOCOL_VERSION,
                study_id=study.id,
                study_uid=study.uid,
                site=site.site_name,
                name=study.name,
                status=study.status,
                terms=study.terms,
                approval=ApprovalReport(state=report.state, digest=report.digest) if report is not None else None,
            )
        )
    return listed


def report_approval(session: Session, site: Principal, study_id: int, report: ApprovalReport, now: datetime) -> None:
    """Record (and commit) what `site` reports of study `study_id`; NotAParticipant unless the study lists the site.

    A study that does not exist is refused alike (403): a site learns nothing of other studies' ids.
    """
    assert site.site_id is not None and site.site_name is not None
    study = session.get(Study, study_id)
    if study is None or not _listing(study, site.site_name):
        raise NotAParticipant.of_study(site.site_name, study_id)
    if report.state == "approved":
        expected = study_digest(study, site.site_name)
        if report.digest != expected:
            raise Conflict(
                f"site {site.site_name} approved digest {report.digest}, but study {study_id}'s terms describe as "
                f"{expected} for it here: the site saw other terms, or runs another cardiofl release",
                code="approval_digest_mismatch",
            )
    try:
        _record(session, site, study_id, report, now)
        session.commit()
    except IntegrityError:  # the site's agent and its operator's command reported at the same instant
        session.rollback()
        _record(session, site, study_id, report, now)
        session.commit()


def _record(session: Session, site: Principal, study_id: int, report: ApprovalReport, now: datetime) -> None:
    assert site.site_id is not None
    row = session.scalar(
        select(SiteApproval).where(SiteApproval.study_id == study_id, SiteApproval.site_id == site.site_id)
    )
    if row is not None and (row.state, row.digest) == (report.state, report.digest):
        return  # nothing changed: no write, no audit event
    if row is None:
        session.add(
            SiteApproval(
                study_id=study_id, site_id=site.site_id, state=report.state, digest=report.digest, reported_at=now
            )
        )
        session.flush()  # a concurrent first report of the same pair fails here, on the unique constraint
    else:
        row.state, row.digest, row.reported_at = report.state, report.digest, now
    audit.record(
        session,
        f"site.{report.state}",
        actor=site.actor,
        study_id=study_id,
        site_id=site.site_id,
        digest=report.digest,
    )


def study_digest(study: Study, site_name: str) -> str:
    """The digest `site_name`'s operator approves of `study`: its terms and what they imply, for that site."""
    return describe(study.terms, study_uid=study.uid, site=site_name, protocol=PROTOCOL_VERSION).digest()


def approved_study_ids(session: Session, site_id: int) -> set[int]:
    """The studies whose tasks `site_id` takes: those its last report says its operator approved."""
    return set(
        session.scalars(
            select(SiteApproval.study_id).where(SiteApproval.site_id == site_id, SiteApproval.state == "approved")
        )
    )


def approval_states(session: Session, study: Study, sites: Iterable[str] | None = None) -> dict[str, str]:
    """Site name -> approved / awaiting approval / declined / not reported, for the sites the study lists."""
    names = list(sites) if sites is not None else study.terms.listed_sites
    rows = session.execute(
        select(Site.name, SiteApproval.state)
        .join(SiteApproval, SiteApproval.site_id == Site.id)
        .where(SiteApproval.study_id == study.id)
    ).all()
    reported = {name: _SHOWN[state] for name, state in rows}
    return {name: reported.get(name, NOT_REPORTED) for name in names}
