"""All routes under /api/v1."""

from __future__ import annotations

from fastapi import APIRouter

from coordinator.api.routes import (
    cards,
    global_models,
    jobs,
    model_files,
    secagg,
    sites,
    status,
    studies,
    tasks,
    tokens,
    updates,
    upload_sessions,
)
from coordinator.api.session_routes import SessionReleasingRoute

api_router = APIRouter(prefix="/api/v1", route_class=SessionReleasingRoute)
ROUTERS = (
    sites, tokens, studies, cards, global_models, model_files, tasks, updates, upload_sessions, secagg, jobs, status
)  # fmt: skip
for module in ROUTERS:
    api_router.include_router(module.router)
