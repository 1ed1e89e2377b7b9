"""The site's long-poll for its next task (204 when there is none)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from coordinator.api.deps import Caller, StateDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.rounds.tasks import next_task
from coordinator.sites.security import Principal
from shared.wire.protocol import TaskSpec

router = APIRouter(prefix="/tasks", tags=["site"], route_class=SessionReleasingRoute)


def _find(state: StateDep, site: Principal) -> TaskSpec | None:
    with state.reading_session() as session:
        return next_task(session, site)


@router.get("/next", responses={200: {"model": TaskSpec}, 204: {"description": "no task before `wait` ran out"}})
async def read_next_task(
    site: Caller, state: StateDep, wait: float = Query(0.0, ge=0, description="seconds to wait for a task")
) -> Response:
    """The calling site's next task; waits up to `wait` seconds (capped by the server) before answering 204."""
    give_up = time.monotonic() + min(wait, state.settings.max_poll_wait_s)
    while True:
        seen = state.tasks_changed.version
        task = await run_in_threadpool(_find, state, site)
        if task is not None:
            return JSONResponse(task.model_dump(mode="json"))
        remaining = give_up - time.monotonic()
        if remaining <= 0 or state.tasks_changed.closed:  # a stopping server answers at once
            return Response(status_code=204)
        # Woken when a commit may have given work: at once for this process's, within the poll interval for others'.
        await state.tasks_changed.wait(seen, remaining)
