"""Turn every failure into {"error": {"code", "message"}} with a stable code; never a stack trace."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from coordinator.api.deps import MAX_ID
from coordinator.api.roles import template_pattern
from coordinator.errors import CoordinatorError, InvalidUpload, Unauthenticated
from coordinator.rounds.updates import record_upload_refusal
from shared.wire.protocol import ErrorBody, ErrorInfo

__all__ = ["install_error_handlers"]

log = logging.getLogger(__name__)

_HTTP_CODES = {
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorInfo(code=code, message=message))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on `app`."""

    @app.exception_handler(CoordinatorError)
    async def coordinator_error(request: Request, exc: CoordinatorError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else exc.headers
        if not isinstance(exc, InvalidUpload):  # those are audited with their digest where they are found
            await _audit_upload_refusal(request, exc.code, exc.message)
        return _error(exc.status_code, exc.code, exc.message, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        await _audit_upload_refusal(request, "invalid_request", problems)
        return _error(422, "invalid_request", problems[:4000])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI's "error parsing the body" (not UTF-8): invalid, like malformed JSON
            return await invalid_request(request, RequestValidationError([{"loc": ("body",), "msg": exc.detail}]))
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        await _audit_upload_refusal(request, code, str(exc.detail))
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names the methods of the first route that matched the path only
            allowed = allowed_methods(app, request.scope["path"].removeprefix(request.scope.get("root_path", "")))
            headers = {**(headers or {}), "Allow": ", ".join(allowed)} if allowed else headers
        return _error(exc.status_code, code, str(exc.detail), headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        """A client that hung up mid-body (a site agent stopped or lost its link): one line, no traceback."""
        log.info("client disconnected during %s %s; the request is dropped", request.method, request.url.path)
        return Response(status_code=400)  # nobody reads it: the connection is gone

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error(500, "internal_error", "internal error; the coordinator's log has the details")


_UPLOAD_PATH = re.compile(r"^/api/v1/rounds/(\d+)/updates$")


async def _audit_upload_refusal(request: Request, code: str, message: str) -> None:
    """Record a refused upload of an authenticated caller in the audit log (the 422s of its bytes are already)."""
    match = _UPLOAD_PATH.match(request.url.path)
    caller = getattr(request.state, "caller", None)
    if request.method != "POST" or match is None or caller is None:
        return  # only uploads; an unauthenticated flood writes nothing
    round_id = int(match.group(1))
    state = request.app.state.coordinator
    try:
        await run_in_threadpool(
            record_upload_refusal, state.sessions, caller, round_id if round_id <= MAX_ID else None, code, message
        )
    except Exception:  # the refusal is answered whatever happens to its audit
        log.exception("could not audit a refused upload")


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some documented operation accepts at `path` (HEAD wherever GET is), sorted."""
    methods: set[str] = set()
    for template, operations in app.openapi()["paths"].items():
        if template_pattern(template).fullmatch(path):
            methods |= {method.upper() for method in operations if _routed(app, method.upper(), path)}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def _routed(app: FastAPI, method: str, path: str) -> bool:
    """Whether the app routes `method` at `path` itself: `/tokens/{token_id:id}` takes no /tokens/me."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)
