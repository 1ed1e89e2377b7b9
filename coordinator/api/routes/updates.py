"""A site uploads its update for a round (raw safetensors with UpdateMeta in the header), or declines its task."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, BackgroundTasks, Response
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from coordinator.api.deps import RAW_BODY, AppState, Id, Participant, SessionDep, StateDep, UpdateBody
from coordinator.db import utc_now
from coordinator.rounds.closing import close_round_if_ready
from coordinator.rounds.declines import record_decline
from coordinator.rounds.updates import accept_update
from coordinator.sites.security import Principal
from coordinator.storage.update_files import IncomingBlob
from shared.wire.protocol import TaskDecline, UpdateReceipt

router = APIRouter(prefix="/rounds", tags=["site"])


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
    round_id: Id, site: Participant, body: UpdateBody, state: StateDep, session: SessionDep, later: BackgroundTasks
) -> JSONResponse:
    """Accept the site's shared tensors, n_k and metrics for an open round; 201 new, 200 repeated.

    A site not selected for the round (or naming no round) is refused (403) before its body is read.
    """
    # In one of upload_slots' threads: an upload waiting for a slot holds none of the threads other requests run in.
    receipt, created = await anyio.to_thread.run_sync(
        _accept, round_id, site, body, state, session, limiter=state.upload_slots
    )
    if created:  # maybe the last expected update: close the round after answering
        later.add_task(
            close_round_if_ready,
            state.sessions,
            round_id,
            now=utc_now(),
            lease_s=state.settings.aggregation_lease_s,
        )
    return JSONResponse(receipt.model_dump(mode="json"), status_code=201 if created else 200)


def _accept(
    round_id: int, site: Principal, body: IncomingBlob, state: AppState, session: Session
) -> tuple[UpdateReceipt, bool]:
    with body.mapped() as data:
        return accept_update(
            session,
            round_id=round_id,
            site=site,
            body=data,
            max_num_examples=state.settings.max_num_examples,
            now=utc_now(),
            digest=body.sha256,
            incoming=body,
        )


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
