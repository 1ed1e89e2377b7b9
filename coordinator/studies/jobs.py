"""A site's due jobs outside rounds (shared/wire/jobs.py): a survey, an evaluation, a validation site's released models.

A site is due a job of each study it approved and has not reported yet:

- `survey`: a running survey study that lists it in `sites`;
- `evaluate`: a running evaluate study that lists it in `sites`: the evaluated model is the study's
  round 0 (theta^g_T and phi_0 of the evaluated study, or the model file the terms name by its digests:
  coordinator/studies/job_kinds.py);
- `external`: a running or completed training study that lists it in `validation_sites`: each
  released theta^g_t (t >= 1) with t a multiple of `validation_every`, or t the final round T.

A site polls this every few seconds. A poll reads the ids, uids and statuses of the studies the site
approved; what a study asks of the site comes from `job_roles`, which reads a study's terms once per
process (they never change, and a uid is unique across databases). Only a study with a job due is
loaded whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.models import GlobalModel, SiteReport, Study, StudyStatus
from coordinator.sites.approvals import approved_study_ids
from coordinator.sites.security import Principal
from shared.study.accounting import trained_rounds
from shared.terms import StudyTerms
from shared.wire.jobs import JobKind, SiteJob, report_url
from shared.wire.protocol import PROTOCOL_VERSION
from shared.wire.urls import global_model_url, initial_local_url

__all__ = ["JobRoles", "due_jobs", "external_rounds_due", "final_round", "job_roles"]

KIND_OF_STUDY = {"survey": JobKind.SURVEY, "evaluate": JobKind.EVALUATE}  # the one job of a study without rounds


@dataclass(frozen=True)
class JobRoles:
    """What a study asks of its sites outside rounds: its kind, its sites in each role, and which models to validate."""

    kind: str  # StudyTerms.kind
    sites: frozenset[str]
    validation_sites: frozenset[str]
    every: int  # validation_every
    trained_rounds: int  # T as the terms plan it (fewer than `rounds` under an epsilon budget)

    @classmethod
    def of(cls, terms: StudyTerms) -> JobRoles:
        """The roles the terms give."""
        return cls(
            kind=terms.kind,
            sites=frozenset(terms.sites),
            validation_sites=frozenset(terms.validation_sites),
            every=terms.validation_every,
            trained_rounds=trained_rounds(terms),
        )

    def job_of(self, site: str) -> JobKind | None:
        """The kind of job the study gives `site`; None for a training site of a training study, or one not listed."""
        if self.kind == "train":
            return JobKind.EXTERNAL if site in self.validation_sites else None
        return KIND_OF_STUDY[self.kind] if site in self.sites else None


_ROLES: dict[str, JobRoles] = {}  # study uid -> its roles, read once per process
_ROLES_KEPT = 4096


def job_roles(session: Session, study_id: int, uid: str) -> JobRoles:
    """The roles of study `study_id` (whose uid is `uid`), its terms read at the first call only."""
    roles = _ROLES.get(uid)
    if roles is None:
        terms = session.scalar(select(Study.terms).where(Study.id == study_id))
        assert terms is not None
        roles = JobRoles.of(terms)
        if len(_ROLES) >= _ROLES_KEPT:
            _ROLES.clear()
        _ROLES[uid] = roles
    return roles


def final_round(status: str, stored: Iterable[int], roles: JobRoles) -> int:
    """T of a training study: its last stored theta^g once completed, else the round its terms end training at."""
    return max(stored, default=0) if status == StudyStatus.COMPLETED else roles.trained_rounds


def external_rounds_due(stored: Iterable[int], every: int, final: int) -> list[int]:
    """The released rounds a validation site evaluates, oldest first: t >= 1, a multiple of `every` or the final T."""
    return sorted(t for t in stored if t >= 1 and (t % every == 0 or t == final))


def _studies_with_jobs(session: Session, site: Principal) -> dict[int, tuple[str, JobKind, JobRoles]]:
    """Study id -> (status, the site's job, roles) of the approved studies that may give `site` a job now."""
    assert site.site_id is not None and site.site_name is not None
    approved = approved_study_ids(session, site.site_id)
    if not approved:
        return {}
    candidates = session.execute(
        select(Study.id, Study.uid, Study.status)
        .where(Study.id.in_(approved), Study.status.in_([StudyStatus.RUNNING, StudyStatus.COMPLETED]))
        .order_by(Study.id)
    ).all()
    wanted: dict[int, tuple[str, JobKind, JobRoles]] = {}
    for study_id, uid, status in candidates:
        roles = job_roles(session, study_id, uid)
        kind = roles.job_of(site.site_name)
        if kind is not None and (status == StudyStatus.RUNNING or kind is JobKind.EXTERNAL):
            wanted[study_id] = (status, kind, roles)
    return wanted


def due_jobs(session: Session, site: Principal) -> list[SiteJob]:
    """The jobs `site` is due now, oldest study first (an external validation's rounds oldest first)."""
    assert site.site_id is not None and site.site_name is not None
    wanted = _studies_with_jobs(session, site)
    if not wanted:
        return []
    reported = {
        (study_id, number)
        for study_id, number in session.execute(
            select(SiteReport.study_id, SiteReport.round_number).where(
                SiteReport.site_id == site.site_id, SiteReport.study_id.in_(wanted)
            )
        )
    }
    models: dict[int, dict[int, GlobalModel]] = {study_id: {} for study_id in wanted}
    for model in session.scalars(select(GlobalModel).where(GlobalModel.study_id.in_(wanted))):
        models[model.study_id][model.round_number] = model
    jobs: list[SiteJob] = []
    for study_id, (status, kind, roles) in wanted.items():
        stored = models[study_id]
        if kind is JobKind.EXTERNAL:
            rounds = external_rounds_due(stored, roles.every, final_round(status, stored, roles))
        else:
            rounds = [0]
        due = [t for t in rounds if (study_id, t) not in reported]
        if due:
            study = session.get(Study, study_id)
            assert study is not None
            jobs.extend(_job(study, site.site_name, kind, t, stored) for t in due)
    return jobs


def _job(study: Study, site_name: str, kind: JobKind, number: int, models: dict[int, GlobalModel]) -> SiteJob:
    """The job of `kind` (of round `number`, external) of `study` for `site_name`; a survey's has no model."""
    initial, model = models.get(0), models.get(number)
    return SiteJob(
        protocol=PROTOCOL_VERSION,
        study_id=study.id,
        study_uid=study.uid,
        site=site_name,
        terms=study.terms,
        kind=kind,
        round=number,
        model_url=global_model_url(study.id, number) if model is not None else None,
        model_sha256=model.sha256 if model is not None else None,
        initial_local_url=initial_local_url(study.id) if initial is not None else None,
        initial_local_sha256=initial.local_sha256 if initial is not None else None,
        report_url=report_url(study.id, kind, number),
    )
