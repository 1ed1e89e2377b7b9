"""The OpenAPI document, completed from the table of roles and each operation's nature: who may call, every refusal.

Nothing here is written per route: an operation's errors follow from its entry in ROUTES (a token:
401; not every role: 403; 409 where it declares conflicts), its path parameters (404, unless only
sites may call it: a site asking about a study or round that is not its own, existing or not, is
told 403 not_a_participant), whether it takes parameters or a body (422), and whether its body is
raw bytes, an update (413, 415). Every error has the one body of the error handler, ErrorBody.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from coordinator.api.deps import UPDATE_MEDIA_TYPES
from coordinator.api.roles import ANY_TOKEN, NO_TOKEN, ROUTES, SITE, Access, role_names
from coordinator.errors import CoordinatorError
from coordinator.models import Role
from shared.wire.protocol import ErrorBody

__all__ = ["error_statuses", "install_openapi"]

SCHEMAS = "#/components/schemas/"
SECURITY_SCHEME = "bearer"
# FastAPI documents its own 422 body; the error handler answers every invalid request with ErrorBody instead.
UNUSED_SCHEMAS = ("HTTPValidationError", "ValidationError")
RAW_BODY_ERRORS = frozenset({413, 415})


def _takes_raw_body(operation: dict[str, Any]) -> bool:
    """Whether the operation's body is raw bytes (an update), read under a size limit and a media type."""
    return bool(UPDATE_MEDIA_TYPES & set(operation.get("requestBody", {}).get("content", {})))


def error_statuses(operation: dict[str, Any], access: Access) -> frozenset[int]:
    """Every error status an operation can answer, from its access rule and what it takes."""
    parameters = operation.get("parameters", [])
    statuses: set[int] = set()
    if access.roles != NO_TOKEN:
        statuses.add(401)
    if access.roles not in (NO_TOKEN, ANY_TOKEN):
        statuses.add(403)
    if access.roles != SITE and any(parameter["in"] == "path" for parameter in parameters):
        statuses.add(404)  # a site-only route answers 403 for what is not the site's, whether or not it exists
    if access.conflicts:
        statuses.add(409)
    if parameters or "requestBody" in operation:
        statuses.add(422)
    if Role.SITE in access.roles:  # a site agent of a protocol this coordinator no longer serves
        statuses.add(426)
    if _takes_raw_body(operation):
        statuses |= RAW_BODY_ERRORS
    return frozenset(statuses)


def _meanings() -> dict[int, str]:
    """What each error status means: the first line of the docstring of the error class that has it."""
    return {cls.status_code: (cls.__doc__ or "").strip().splitlines()[0] for cls in CoordinatorError.__subclasses__()}


def _error_response(status: int, meanings: dict[int, str]) -> dict[str, Any]:
    """The response of an error status: its meaning and the ErrorBody schema."""
    response: dict[str, Any] = {
        "description": meanings[status],
        "content": {"application/json": {"schema": {"$ref": f"{SCHEMAS}{ErrorBody.__name__}"}}},
    }
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}}
    return response


def _add_error_body(schema: dict[str, Any]) -> None:
    """ErrorBody and the models it uses, under components/schemas."""
    body = ErrorBody.model_json_schema(ref_template=SCHEMAS + "{model}", mode="serialization")
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(body.pop("$defs", {}))
    schemas[ErrorBody.__name__] = body
    for name in UNUSED_SCHEMAS:
        schemas.pop(name, None)


def _document_operation(operation: dict[str, Any], access: Access, meanings: dict[int, str]) -> None:
    """Add the roles, the security requirement and the error responses of the operation."""
    roles = ", ".join(role_names(access.roles)) if access.roles != NO_TOKEN else "anyone, without a token"
    operation["description"] = f"{operation.get('description', '').rstrip()}\n\nRoles: {roles}.".lstrip()
    if access.roles != NO_TOKEN:
        operation["security"] = [{SECURITY_SCHEME: []}]
    responses = operation.setdefault("responses", {})
    declared = {int(code) for code in responses if code.isdigit() and int(code) >= 400}  # a route's own, e.g. 503
    for status in sorted(error_statuses(operation, access) | declared):
        responses[str(status)] = _error_response(status, meanings)


def document(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every operation's roles and errors added (changed in place, and returned)."""
    meanings = _meanings()
    _add_error_body(schema)
    schema["components"]["securitySchemes"] = {
        SECURITY_SCHEME: {"type": "http", "scheme": "bearer", "description": "an API token (cfl_...)"}
    }
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            _document_operation(operation, ROUTES[(method.upper(), path)], meanings)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` return FastAPI's document completed by `document`, built once per process.

    Building it takes FastAPI about half a second; an app with the same routes and descriptions as
    one before it (a test's, or a worker's) takes a copy of that one's document instead.
    """
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            key = _document_key(app)
            if key not in _DOCUMENTS:
                _DOCUMENTS[key] = copy.deepcopy(document(build()))
            app.openapi_schema = copy.deepcopy(_DOCUMENTS[key])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_DOCUMENTS: dict[Hashable, dict[str, Any]] = {}  # completed documents by what FastAPI builds them from


def _document_key(app: FastAPI) -> Hashable:
    """What FastAPI builds an app's document from: its descriptions and each documented route."""
    routes = tuple(
        (
            route.path,
            frozenset(route.methods or ()),
            route.endpoint,
            route.name,
            route.response_model,
            route.status_code,
        )
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema  # what FastAPI documents, and only that
    )
    described = (app.title, app.version, app.openapi_version, app.summary, app.description)
    return (*described, repr(app.servers), repr(app.openapi_tags), repr(app.webhooks.routes), routes)
