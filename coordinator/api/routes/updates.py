"""A site uploads its update for a round (raw safetensors with UpdateMeta in the header), or declines its task."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, BackgroundTasks, Request, Response

from coordinator.api.deps import RAW_BODY, Id, Participant, SessionDep, StateDep, spooled_body
from coordinator.api.routes.upload_sessions import accept_spooled, receive_announced, round_upload_limit
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.rounds.closing import close_round_if_ready
from coordinator.rounds.declines import record_decline
from shared.wire.protocol import UPLOAD_SHA256_HEADER, TaskDecline, UpdateReceipt

router = APIRouter(prefix="/rounds", tags=["site"], route_class=SessionReleasingRoute)


@router.post(
    "/{round_id}/updates",
    status_code=201,
    responses={
        201: {"model": UpdateReceipt, "description": "the update is accepted: its receipt"},
        200: {"model": UpdateReceipt, "description": "the same bytes again: the first receipt"},
    },
    openapi_extra=RAW_BODY,
)
async def upload_update(
    round_id: Id, request: Request, site: Participant, state: StateDep, session: SessionDep, later: BackgroundTasks
) -> Response:
    """Accept the site's shared tensors, n_k and metrics for an open round; 201 new, 200 repeated.

    A site not selected for the round (or naming no round) is refused (403) before its body is read.
    Sent with its sha256 (`Upload-Sha256`), an update cut on the way resumes (routes/upload_sessions.py).
    """
    limit = await anyio.to_thread.run_sync(round_upload_limit, state, round_id)
    if UPLOAD_SHA256_HEADER in request.headers and request.headers.get("content-length", "").isdigit():
        return await receive_announced(request, round_id, site, state, session, later, limit=limit)
    async with spooled_body(request, state, limit) as body:
        return await accept_spooled(round_id, site, body, state, session, later)


@router.post("/{round_id}/decline", status_code=204, response_class=Response)
def decline_task(
    round_id: Id, body: TaskDecline, site: Participant, state: StateDep, session: SessionDep, later: BackgroundTasks
) -> Response:
    """The site will not do its task of this round attempt, and says why; the round goes on without it."""
    if record_decline(session, round_id=round_id, site=site, reason=body.reason, now=utc_now()):
        later.add_task(
            close_round_if_ready, state.sessions, round_id, now=utc_now(), lease_s=state.settings.aggregation_lease_s
        )
    return Response(status_code=204)
