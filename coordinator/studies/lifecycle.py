"""Studies: creation with validated terms, and the researcher's start / pause / resume / cancel."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, cast

from pydantic import BaseModel
from sqlalchemy import func, select, update
from sqlalchemy.engine import CursorResult  # an UPDATE's result, which Session.execute types as a Result
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.errors import Conflict, InvalidTransition, NotFound, UnknownSites, Unprocessable
from coordinator.models import GlobalModel, Round, RoundStatus, Site, Study, StudyStatus
from coordinator.rounds.opening import open_round
from coordinator.sites.access import signing_keys
from coordinator.sites.security import Principal
from coordinator.storage.blobs import put_blob
from coordinator.storage.retention import release_updates
from coordinator.studies.job_kinds import start_without_rounds, with_evaluated_model
from shared.algorithms.registry import plugin_uses
from shared.errors import PluginIdentityError
from shared.study.accounting import budget_problem
from shared.study.checks import checked_terms
from shared.study.rules import initial_state
from shared.study.survey import survey_budget_problem
from shared.tensors.codec import dump_pieces
from shared.terms import StudyTerms, SurveySpec, TermsError

__all__ = [
    "cancel_study",
    "create_study",
    "get_study",
    "list_studies",
    "pause_study",
    "resume_study",
    "start_study",
]


def create_study(
    session: Session, *, name: str, terms: StudyTerms, by: Principal, max_epsilon: float | None = None
) -> Study:
    """Record a draft study; every site it names must be enrolled (under secure aggregation, with its signing key).

    Its terms are checked whole first (shared/study/checks.py: 422 `invalid_request` naming each setting, as the
    API's body validation does); its epsilon over all its rounds must stay within its own budget and
    `max_epsilon`, the coordinator's cap. An evaluate study's terms take the evaluated study's model first, or
    the model file they name is checked against them (coordinator/studies/job_kinds.py).
    """
    try:
        if terms.kind == "evaluate":
            terms = with_evaluated_model(session, terms)
        terms = checked_terms(terms)
    except TermsError as exc:
        raise Unprocessable("; ".join(f"body.config.{problem}" for problem in exc.problems)) from None
    if terms.kind == "survey":  # a survey's only release is its counts: under a cap, noised within it
        survey = terms.survey or SurveySpec()
        problem = survey_budget_problem(survey.noise_sigma, survey.delta, max_epsilon)
        if problem is not None:
            raise Unprocessable(f"survey.noise_sigma: {problem}", code="privacy_budget")
    elif terms.kind == "train":  # an evaluation releases no model: the cap is of released models and counts
        problem = budget_problem(terms, max_epsilon)
        if problem is not None:
            raise Unprocessable(f"privacy.dp: {problem}", code="privacy_budget")
    enrolled = set(session.scalars(select(Site.name).where(Site.name.in_(terms.listed_sites))))
    unknown = [site for site in terms.listed_sites if site not in enrolled]
    if unknown:
        raise UnknownSites(f"sites not enrolled: {', '.join(unknown)}")
    terms = _with_signing_keys(session, _with_plugin(terms))
    study = Study(name=name, terms=terms, status=StudyStatus.DRAFT, created_by=by.actor)
    session.add(study)
    session.flush()
    audit.record(session, "study.created", actor=by.actor, study_id=study.id, name=name)
    session.commit()
    return study


def _with_plugin(terms: StudyTerms) -> StudyTerms:
    """The terms with the identities of the plug-ins that provide their model and algorithm here, which sites approve.

    A study may name an identity itself (a researcher who pinned it): it must be the one installed here.
    A plug-in installed here without an identity (its distribution has no RECORD ...) is refused.
    """
    parts: dict[str, BaseModel] = {}
    for use in plugin_uses(terms):
        try:
            installed, named = use.installed, use.named
        except PluginIdentityError as exc:
            raise Conflict(f"{use.part} {use.name!r}: {exc}", code="plugin_unidentifiable") from None
        if named is not None and named != installed:
            shown = f"{installed.distribution} {installed.version}" if installed else "cardiofl's own"
            raise Conflict(
                f"{use.part} {use.name!r}: the terms name plug-in {named.distribution} {named.version} "
                f"(files {named.sha256[:12]}), this coordinator has {shown}",
                code="plugin_mismatch",
            )
        if installed is not None:
            parts[use.part] = getattr(terms, use.part).model_copy(update={"plugin": installed})
    return terms.model_copy(update=parts) if parts else terms


def _with_signing_keys(session: Session, terms: StudyTerms) -> StudyTerms:
    """A secure study's terms with every site's registered signing key in them, which its operators then approve."""
    secure = terms.privacy.secure_aggregation
    if secure is None:
        return terms
    registered = signing_keys(session, terms.sites)
    missing = sorted(site for site, key in registered.items() if key is None)
    if missing:
        raise Conflict(
            f"sites {', '.join(missing)} have registered no signing key yet: start each one's agent once "
            "(`cardiofl site run` registers it), then create the study",
            code="signing_keys_missing",
        )
    keys = {site: str(key) for site, key in registered.items()}
    if secure.site_keys and secure.site_keys != keys:
        differ = sorted(site for site in keys if secure.site_keys.get(site) != keys[site])
        raise Conflict(f"the terms name other signing keys than sites {differ} registered", code="signing_key_conflict")
    privacy = terms.privacy.model_copy(update={"secure_aggregation": secure.model_copy(update={"site_keys": keys})})
    return terms.model_copy(update={"privacy": privacy})


def get_study(session: Session, study_id: int) -> Study:
    """The study with id `study_id`."""
    study = session.get(Study, study_id)
    if study is None:
        raise NotFound(f"study {study_id}")
    return study


def list_studies(session: Session) -> list[Study]:
    """Every study, newest first."""
    return list(session.scalars(select(Study).order_by(Study.id.desc())))


def _transition(
    session: Session, study_id: int, allowed: set[StudyStatus], target: StudyStatus, now: datetime
) -> Study:
    """Conditional UPDATE of the study's status: exactly one concurrent caller wins."""
    study = get_study(session, study_id)
    changed = cast(
        "CursorResult[Any]",
        session.execute(
            update(Study)
            .where(Study.id == study_id, Study.status.in_([s.value for s in allowed]))
            .values(status=target, updated_at=now)
        ),
    )
    if changed.rowcount != 1:
        session.rollback()
        raise InvalidTransition(f"study {study_id} is {get_study(session, study_id).status}; cannot become {target}")
    session.refresh(study)
    return study


def start_study(session: Session, *, study_id: int, by: Principal, now: datetime) -> Study:
    """Move draft -> running: store round 0 (theta^g_0 and phi_0 of the seeded model) and open round 1.

    A survey or evaluate study opens no round: its sites' jobs start (coordinator/studies/job_kinds.py).
    """
    config = get_study(session, study_id).terms
    if config.kind != "train":
        study = _transition(session, study_id, {StudyStatus.DRAFT}, StudyStatus.RUNNING, now)
        start_without_rounds(session, study, by=by)
        session.commit()
        return study
    shared, local = initial_state(config)
    theta = dump_pieces(shared, {"study": str(study_id), "round": "0", "part": "global"})
    phi = dump_pieces(local, {"study": str(study_id), "round": "0", "part": "initial_local"})
    study = _transition(session, study_id, {StudyStatus.DRAFT}, StudyStatus.RUNNING, now)
    theta_sha, phi_sha = put_blob(session, theta), put_blob(session, phi)
    session.add(GlobalModel(study_id=study_id, round_number=0, sha256=theta_sha, local_sha256=phi_sha))
    audit.record(session, "study.running", actor=by.actor, study_id=study_id, digest=theta_sha, initial_local=phi_sha)
    open_round(
        session, study_id=study_id, terms=config, number=1, attempt=1, base_sha256=theta_sha, now=now, actor=by.actor
    )
    session.commit()
    return study


def pause_study(session: Session, *, study_id: int, by: Principal, now: datetime) -> Study:
    """Move running -> paused: no task is handed out and no round closes; uploads to the open round still count."""
    study = _transition(session, study_id, {StudyStatus.RUNNING}, StudyStatus.PAUSED, now)
    audit.record(session, "study.paused", actor=by.actor, study_id=study_id)
    session.commit()
    return study


def resume_study(session: Session, *, study_id: int, by: Principal, now: datetime) -> Study:
    """Move paused -> running: the open round gets a full deadline again, or the next round opens.

    A study without rounds (survey, evaluate) gets a full deadline from now (coordinator/rounds/job_studies.py).
    """
    study = _transition(session, study_id, {StudyStatus.PAUSED}, StudyStatus.RUNNING, now)
    config = study.terms
    audit.record(session, "study.running", actor=by.actor, study_id=study_id, resumed=True)
    if config.kind != "train":
        session.commit()
        return study
    active = cast(
        "CursorResult[Any]",
        session.execute(
            update(Round)
            .where(Round.study_id == study_id, Round.status == RoundStatus.OPEN)
            .values(deadline_at=now + timedelta(seconds=config.round_deadline_s))
        ),
    ).rowcount
    aggregating = session.scalar(
        select(func.count()).where(Round.study_id == study_id, Round.status == RoundStatus.AGGREGATING)
    )
    if not active and not aggregating:
        latest = session.scalar(
            select(GlobalModel).where(GlobalModel.study_id == study_id).order_by(GlobalModel.round_number.desc())
        )
        assert latest is not None  # a started study always has theta^g_0
        open_round(
            session,
            study_id=study_id,
            terms=config,
            number=latest.round_number + 1,
            attempt=1,
            base_sha256=latest.sha256,
            now=now,
            actor=by.actor,
        )
    session.commit()
    return study


def cancel_study(session: Session, *, study_id: int, by: Principal, now: datetime) -> Study:
    """Any unfinished status -> cancelled, with its open or aggregating round."""
    unfinished = {StudyStatus.DRAFT, StudyStatus.RUNNING, StudyStatus.PAUSED}
    study = _transition(session, study_id, unfinished, StudyStatus.CANCELLED, now)
    cancelled = session.scalars(
        update(Round)
        .where(Round.study_id == study_id, Round.status.in_([RoundStatus.OPEN, RoundStatus.AGGREGATING]))
        .values(status=RoundStatus.CANCELLED, closed_at=now, note="study cancelled")
        .returning(Round.id)
    ).all()
    audit.record(session, "study.cancelled", actor=by.actor, study_id=study_id, rounds=list(cancelled))
    session.commit()
    release_updates(session, round_ids=cancelled)  # what the cancelled rounds received is not needed now
    return study
