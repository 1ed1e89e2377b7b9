"""Studies: create, list, read, start / pause / resume / cancel, rounds, audit trail."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.api.deps import Caller, Id, SessionDep, StateDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.errors import NotFound
from coordinator.models import AuditEvent, Round, RoundStatus, Study, StudyStatus
from coordinator.sites.security import Principal
from coordinator.studies import lifecycle as studies
from coordinator.studies.views import round_view, rounds_view, study_view
from shared.wire.api import AuditEventPublic, Page, RoundPublic, StudyCreate, StudyPublic

router = APIRouter(prefix="/studies", tags=["studies"], route_class=SessionReleasingRoute)

# The rules across fields that a JSON schema cannot say: each refusal is a 422 with its code.
CREATE_RULES = """Create a draft study; every site it names must be enrolled, its epsilon within its budget and the cap.

Beyond the schema, the terms are checked whole (shared/terms/study_terms.py, shared/study/checks.py).
A rule across fields that they break is refused with **422 `invalid_request`**, each message naming the
setting to change (`body.config.min_sites: ...`). Among them:

- `sites` are distinct; `min_sites` is at most their number; `validation_sites` are not among `sites`;
- `kind` has its own part alone (`survey` for a survey, `evaluation` for an evaluate study);
- `algorithm`, `aggregation` and `participation` name registered rules, whose `params` their rule accepts;
- `privacy.secure_aggregation` needs `min_sites >= 2` and a setup (neighbour_count, threshold, colluding)
  the sites can run;
- `privacy.dp` needs `aggregation.name = "equal"` and an algorithm that uploads model tensors only;
  `privacy.dp.mode = "distributed"` needs `privacy.secure_aggregation`;
- `model.site_heads` and `learned_heads` run without `privacy.dp`.

**422 `privacy_budget`**: epsilon over the study's rounds exceeds `privacy.dp.epsilon_budget` or the
coordinator's cap (CARDIOFL_MAX_EPSILON, which also refuses studies without DP), or `privacy.dp.accountant`
is `"pld"`. **422 `unknown_sites`**: a site it names is not enrolled."""


@router.post("", status_code=201, description=CREATE_RULES)
def create_study(body: StudyCreate, researcher: Caller, session: SessionDep, state: StateDep) -> StudyPublic:
    """Create a draft study; every site it names must be enrolled, its epsilon within its budget and the cap."""
    cap = state.settings.max_epsilon
    study = studies.create_study(session, name=body.name, terms=body.config, by=researcher, max_epsilon=cap)
    return study_view(session, study)


@router.get("")
def read_studies(session: SessionDep) -> Page[StudyPublic]:
    """Every study, newest first."""
    views = [study_view(session, study) for study in studies.list_studies(session)]
    return Page(data=views, count=len(views))


@router.get("/{study_id}")
def read_study(study_id: Id, session: SessionDep) -> StudyPublic:
    """One study and where it stands."""
    return study_view(session, studies.get_study(session, study_id))


Transition = Callable[..., Study]


def _transition(change: Transition, study_id: int, researcher: Principal, session: Session) -> StudyPublic:
    study = change(session, study_id=study_id, by=researcher, now=utc_now())
    return study_view(session, study)


@router.post("/{study_id}/start")
def start_study(study_id: Id, researcher: Caller, session: SessionDep) -> StudyPublic:
    """Store round 0 (the seeded theta^g_0 and phi_0) and open round 1."""
    return _transition(studies.start_study, study_id, researcher, session)


@router.post("/{study_id}/pause")
def pause_study(study_id: Id, researcher: Caller, session: SessionDep) -> StudyPublic:
    """Stop handing out tasks and closing rounds; uploads to the open round still count."""
    return _transition(studies.pause_study, study_id, researcher, session)


@router.post("/{study_id}/resume")
def resume_study(study_id: Id, researcher: Caller, session: SessionDep) -> StudyPublic:
    """Continue: the open round gets a full deadline again, or the next round opens."""
    return _transition(studies.resume_study, study_id, researcher, session)


@router.post("/{study_id}/cancel")
def cancel_study(study_id: Id, researcher: Caller, session: SessionDep) -> StudyPublic:
    """End the study for good, cancelling its open or aggregating round."""
    return _transition(studies.cancel_study, study_id, researcher, session)


SETTLED = frozenset({RoundStatus.COMPLETED, RoundStatus.FAILED, RoundStatus.CANCELLED})
UNDER_WAY = frozenset({StudyStatus.DRAFT, StudyStatus.RUNNING, StudyStatus.PAUSED})


def _rounds_now(state: StateDep, study_id: int) -> tuple[list[RoundPublic], bool]:
    """(every round attempt, whether the study may still settle more)."""
    with state.reading_session() as session:
        study = studies.get_study(session, study_id)
        return rounds_view(session, study), study.status in UNDER_WAY


@router.get("/{study_id}/rounds")
async def read_rounds(
    study_id: Id,
    state: StateDep,
    settled: int | None = Query(None, ge=0, description="wait until more round attempts than this have settled"),
    wait: float = Query(0.0, ge=0, description="seconds to wait for that (capped by the server)"),
) -> Page[RoundPublic]:
    """Every round attempt, oldest first, with per-site and pooled summaries.

    With `settled` (a long-poll, as `cardiofl study watch` and CardioflClient.watch_rounds use it), the
    answer waits up to `wait` seconds until more than `settled` attempts are completed, failed or
    cancelled, or the study has ended; then, or when the time is up, it answers as without.
    """
    give_up = time.monotonic() + min(wait, state.settings.max_poll_wait_s)
    while True:
        seen = state.tasks_changed.version
        rounds, under_way = await run_in_threadpool(_rounds_now, state, study_id)
        done = sum(RoundStatus(r.status) in SETTLED for r in rounds)
        remaining = give_up - time.monotonic()
        if settled is None or done > settled or not under_way or remaining <= 0 or state.tasks_changed.closed:
            return Page(data=rounds, count=len(rounds))
        # Woken when a round settles (it opens the next or ends the study): at once by this process, within
        # the poll interval by another (the work version).
        await state.tasks_changed.wait(seen, remaining)


@router.get("/{study_id}/rounds/{number}")
def read_round(study_id: Id, number: Id, session: SessionDep) -> RoundPublic:
    """The latest attempt of round `number`."""
    study = studies.get_study(session, study_id)
    round_ = session.scalar(
        select(Round).where(Round.study_id == study_id, Round.number == number).order_by(Round.attempt.desc()).limit(1)
    )
    if round_ is None:
        raise NotFound(f"round {number} of study {study_id}")
    return round_view(session, study, round_)


@router.get("/{study_id}/audit")
def read_audit(study_id: Id, session: SessionDep) -> Page[AuditEventPublic]:
    """The study's audit trail, oldest first."""
    studies.get_study(session, study_id)
    events = session.scalars(select(AuditEvent).where(AuditEvent.study_id == study_id).order_by(AuditEvent.id))
    views = [AuditEventPublic.model_validate(event) for event in events]
    return Page(data=views, count=len(views))
