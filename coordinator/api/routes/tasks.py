"""The site's long-poll for its next task (204 when there is none, early when other work appeared meanwhile)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from coordinator.api.deps import Caller, StateDep
from coordinator.rounds.tasks import next_task
from coordinator.sites.security import Principal
from coordinator.studies.poll_news import PollNews, poll_news
from shared.wire.protocol import OTHER_WORK_HEADER, TaskSpec

router = APIRouter(prefix="/tasks", tags=["site"])


def _look(state: StateDep, site: Principal) -> TaskSpec | PollNews:
    """The site's task, else what its poll watches besides (coordinator/studies/poll_news.py)."""
    with state.reading_session() as session:
        task = next_task(session, site)
        return task if task is not None else poll_news(session, site)


@router.get(
    "/next",
    responses={
        200: {"model": TaskSpec},
        204: {"description": f"no task before `wait` ran out, or sooner with {OTHER_WORK_HEADER}: study or job"},
    },
)
async def read_next_task(
    site: Caller, state: StateDep, wait: float = Query(0.0, ge=0, description="seconds to wait for a task")
) -> Response:
    """The calling site's next task; waits up to `wait` seconds (capped by the server) before answering 204.

    It answers 204 sooner, naming it in OTHER_WORK_HEADER, when a study was created while it waited, or
    the site fell due a job outside rounds since its last poll: the agent decides on the study, or runs
    the job, now (coordinator/studies/poll_news.py).
    """
    assert site.site_id is not None
    give_up = time.monotonic() + min(wait, state.settings.max_poll_wait_s)
    began: PollNews | None = None
    while True:
        seen = state.tasks_changed.version
        found = await run_in_threadpool(_look, state, site)
        if isinstance(found, TaskSpec):
            return JSONResponse(found.model_dump(mode="json"))
        began = began or found.knowing(state.jobs_polled.get(site.site_id))
        news = found.since(began)
        remaining = give_up - time.monotonic()
        if news is not None or remaining <= 0 or state.tasks_changed.closed:  # a stopping server answers at once
            state.jobs_polled[site.site_id] = found.due_jobs
            return Response(status_code=204, headers={OTHER_WORK_HEADER: news} if news is not None else None)
        # Woken when a commit may have given work: at once for this process's, within the poll interval for others'.
        await state.tasks_changed.wait(seen, remaining)
