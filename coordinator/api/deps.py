"""Request dependencies, declared once: app state, sessions, the caller and its role, the update body."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from coordinator.config import CoordinatorSettings
from coordinator.errors import PayloadTooLarge, Unauthenticated, UnsupportedMediaType
from coordinator.models import Role
from coordinator.security import Principal, authenticate

__all__ = [
    "Admin",
    "AppState",
    "Caller",
    "Reader",
    "Researcher",
    "SessionDep",
    "SiteCaller",
    "StateDep",
    "UpdateBody",
]


@dataclass
class AppState:
    """What every request needs: the settings, the engine and its sessions."""

    settings: CoordinatorSettings
    engine: Engine
    sessions: sessionmaker[Session]


def get_state(request: Request) -> AppState:
    """The app's state, built by create_app."""
    return request.app.state.coordinator


StateDep = Annotated[AppState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    """A session for the request; it begins a transaction only when first used, and close() rolls back."""
    with state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_caller(state: StateDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    """The caller behind `Authorization: Bearer <token>`, looked up in a short session of its own."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("send the token as 'Authorization: Bearer <token>'")
    with state.sessions() as session:
        return authenticate(session, token.strip(), state.settings.admin_token)


Caller = Annotated[Principal, Depends(get_caller)]


def _role(*roles: Role) -> Callable[[Principal], Principal]:
    def check(caller: Caller) -> Principal:
        return caller.require(*roles)

    return check


Admin = Annotated[Principal, Depends(_role(Role.ADMIN))]
Researcher = Annotated[Principal, Depends(_role(Role.ADMIN, Role.RESEARCHER))]
Reader = Annotated[Principal, Depends(_role(Role.ADMIN, Role.RESEARCHER, Role.VIEWER))]
SiteCaller = Annotated[Principal, Depends(_role(Role.SITE))]

UPDATE_MEDIA_TYPES = {"application/octet-stream", "application/vnd.safetensors", ""}


async def read_update_body(request: Request, state: StateDep) -> bytearray:
    """The raw safetensors body, streamed into memory with the configured size limit."""
    limit = state.settings.max_upload_bytes
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in UPDATE_MEDIA_TYPES:
        raise UnsupportedMediaType(f"send the update as application/octet-stream, not {media_type!r}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
    return body


UpdateBody = Annotated[bytearray, Depends(read_update_body)]
