"""A site's part in a secure round: read what is relayed to it, post its message of each phase."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, BackgroundTasks, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from coordinator.api.deps import Id, Participant, SessionDep, StateDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.rounds import secure_messages
from coordinator.rounds.closing import close_round_if_ready
from coordinator.sites.security import Principal
from shared.wire.secure import Advertisement, Consistency, Reveal, SecureRoundView, ShareBatch

router = APIRouter(prefix="/rounds", tags=["site"], route_class=SessionReleasingRoute)

_STORED: dict[int | str, dict[str, Any]] = {
    201: {"description": "stored"},
    200: {"description": "the same message again: nothing changed"},
}


def _look(state: StateDep, round_id: int, site: Principal) -> tuple[SecureRoundView, bool]:
    with state.reading_session() as session:
        return secure_messages.look(session, round_id, site)


@router.get("/{round_id}/secagg")
async def read_secure_round(
    round_id: Id,
    site: Participant,
    state: StateDep,
    wait: float = Query(0.0, ge=0, description="seconds to wait while the site can only wait for others"),
) -> SecureRoundView:
    """The round's phase and what the site needs from it; waits up to `wait` s (capped) for its next move."""
    give_up = time.monotonic() + min(wait, state.settings.max_poll_wait_s)
    seen = state.tasks_changed.version
    first, move = await run_in_threadpool(_look, state, round_id, site)
    found = first
    while not move and (found.status, found.phase) == (first.status, first.phase):
        remaining = give_up - time.monotonic()
        if remaining <= 0 or state.tasks_changed.closed:  # a stopping server answers at once
            break
        # Woken when a round moves on: at once by this process, within the poll interval by another (the work version).
        await state.tasks_changed.wait(seen, remaining)
        seen = state.tasks_changed.version
        found, move = await run_in_threadpool(_look, state, round_id, site)
    return found


def _post(
    round_id: int,
    site: Principal,
    phase: int,
    message: BaseModel,
    state: StateDep,
    session: SessionDep,
    later: BackgroundTasks,
) -> JSONResponse:
    created = secure_messages.receive(
        session,
        round_id=round_id,
        site=site,
        phase=phase,
        message=message,
        max_num_examples=state.settings.max_num_examples,
        now=utc_now(),
    )
    if created:  # maybe the last message of the phase: move on after answering
        later.add_task(
            close_round_if_ready, state.sessions, round_id, now=utc_now(), lease_s=state.settings.aggregation_lease_s
        )
    return JSONResponse({"round_id": round_id, "phase": phase}, status_code=201 if created else 200)


@router.post("/{round_id}/secagg/advertisement", status_code=201, responses=_STORED)
def post_advertisement(
    round_id: Id, body: Advertisement, site: Participant, state: StateDep, session: SessionDep, later: BackgroundTasks
) -> JSONResponse:
    """Phase 0: the site's public keys of this round, n_k, its scalar metrics and theta^g's digest, signed."""
    return _post(round_id, site, secure_messages.ADVERTISE, body, state, session, later)


@router.post("/{round_id}/secagg/shares", status_code=201, responses=_STORED)
def post_shares(
    round_id: Id, body: ShareBatch, site: Participant, state: StateDep, session: SessionDep, later: BackgroundTasks
) -> JSONResponse:
    """Phase 1: the site's sealed Shamir shares, one for each neighbour that advertised."""
    return _post(round_id, site, secure_messages.SHARE, body, state, session, later)


@router.post("/{round_id}/secagg/consistency", status_code=201, responses=_STORED)
def post_consistency(
    round_id: Id, body: Consistency, site: Participant, state: StateDep, session: SessionDep, later: BackgroundTasks
) -> JSONResponse:
    """Phase 3: the survivor's signature of the survivor set, the dropped set and the advertisers it was told."""
    return _post(round_id, site, secure_messages.CONSISTENCY, body, state, session, later)


@router.post("/{round_id}/secagg/reveal", status_code=201, responses=_STORED)
def post_reveal(
    round_id: Id, body: Reveal, site: Participant, state: StateDep, session: SessionDep, later: BackgroundTasks
) -> JSONResponse:
    """Phase 4: the shares the coordinator needs to remove the survivors' and the dropped sites' masks."""
    return _post(round_id, site, secure_messages.REVEAL, body, state, session, later)
