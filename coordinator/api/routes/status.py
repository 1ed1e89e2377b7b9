"""Service status: a summary for dashboards, and a health check for load balancers."""

from __future__ import annotations

import logging

import anyio
from fastapi import APIRouter
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from coordinator.api.deps import AppState, StateDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import reading, utc_now
from coordinator.errors import DatabaseUnavailable
from coordinator.studies.views import status_report
from shared.release import release_version
from shared.wire.api import HealthReport, StatusReport
from shared.wire.protocol import PROTOCOL_VERSION

log = logging.getLogger(__name__)

router = APIRouter(tags=["status"], route_class=SessionReleasingRoute)


def _report(state: AppState) -> StatusReport:
    uploads = state.upload_sessions.held()  # before the read: an upload finished meanwhile shows as its update
    downloads = state.downloads.held()
    with state.reading_session() as session:
        return status_report(session, utc_now(), uploads, downloads)


@router.get("/status")
async def read_status(state: StateDep) -> StatusReport:
    """Studies and their current round, round counts by status, sites with last contact, current task and transfers.

    Its reads take one trip to one of the operators' request threads (not one for the session, one
    for the route and one to close it), so it never waits behind the trips of woken sites' polls.
    """
    return await anyio.to_thread.run_sync(_report, state, limiter=state.operator_threads)


def _database_answers(state: AppState) -> None:
    with reading(state.engine).connect() as connection:  # takes no write lock: answers while a writer works
        connection.execute(text("SELECT 1"))


@router.get("/health", responses={503: {}})
async def read_health(state: StateDep) -> HealthReport:
    """Liveness and the database, without authentication: the release, the protocol, the database answering.

    In one of the operators' request threads, so that a load balancer's check is not held up by sites.
    """
    try:
        await anyio.to_thread.run_sync(_database_answers, state, limiter=state.operator_threads)
    except SQLAlchemyError as exc:
        log.warning("health check: the database does not answer: %s", exc)
        raise DatabaseUnavailable(f"the database does not answer: {type(exc).__name__}") from None
    return HealthReport(status="ok", version=release_version(), protocol=PROTOCOL_VERSION, database="ok")
