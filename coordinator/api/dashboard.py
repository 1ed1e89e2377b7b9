"""The status dashboard: one self-contained page (no CDN) that reads the API with a viewer token."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from coordinator.api.session_routes import SessionReleasingRoute

router = APIRouter(tags=["dashboard"], route_class=SessionReleasingRoute)


@cache
def _page() -> str:
    return files("coordinator").joinpath("static/dashboard.html").read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def read_dashboard() -> HTMLResponse:
    """The page itself holds no data; its script fetches the read-only API with the viewer's token."""
    return HTMLResponse(
        _page(),
        headers={
            "Cache-Control": "no-store",
            # everything is inline and same-origin: nothing is loaded from elsewhere
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff",
        },
    )
