"""Service status: a summary for dashboards, and a health check for load balancers."""

from __future__ import annotations

from fastapi import APIRouter

from coordinator.api.deps import SessionDep
from coordinator.db import utc_now
from coordinator.studies.views import status_report
from shared.wire.api import StatusReport

router = APIRouter(tags=["status"])


@router.get("/status")
def read_status(session: SessionDep) -> StatusReport:
    """Studies and their current round, round counts by status, sites with last contact and current task."""
    return status_report(session, utc_now())


@router.get("/health")
def read_health() -> dict[str, str]:
    """Liveness, without authentication."""
    return {"status": "ok"}
