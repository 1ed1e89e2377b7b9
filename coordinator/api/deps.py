"""Request dependencies, declared once: app state, sessions, the admitted caller, the spooled update body."""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path as PathOf
from typing import Annotated, Any, cast

import anyio
from fastapi import Depends, Path, Request
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.convertors import Convertor, register_url_convertor

from coordinator.api.roles import NO_TOKEN, Access, access_for
from coordinator.config import CoordinatorSettings
from coordinator.db import DOWNLOAD_CACHE, reading
from coordinator.errors import (
    AgentTooOld,
    Forbidden,
    NotAParticipant,
    PayloadTooLarge,
    Unauthenticated,
    UnsupportedMediaType,
)
from coordinator.models import Role, Round
from coordinator.signals.waiters import TaskSignal
from coordinator.sites.security import Principal, authenticate, mark_seen
from coordinator.storage.download_cache import BlobCache
from coordinator.storage.download_progress import DownloadsUnderWay
from coordinator.storage.update_files import BlobStore, FileBlobStore, IncomingBlob
from coordinator.storage.upload_sessions import UploadSessions
from shared.wire.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_HEADER

__all__ = [
    "AppState",
    "Caller",
    "Id",
    "ModelBody",
    "Participant",
    "RAW_BODY",
    "SessionDep",
    "StateDep",
    "authorize",
    "spooled_body",
]


@dataclass
class AppState:
    """What every request needs: settings, engine and sessions, blob store, upload slots, task signal, cache."""

    settings: CoordinatorSettings
    engine: Engine
    sessions: sessionmaker[Session]
    blob_store: BlobStore | None = None  # where uploaded updates are kept; None: in the database
    # Uploads checked and stored at once, each in a thread of its own; each maps its whole body, so memory stays
    # bounded however many arrive, and the others wait without holding a thread that other requests need.
    upload_slots: anyio.CapacityLimiter = field(init=False)
    # Request threads of every caller but sites (settings.operator_threads), beside the default ones.
    operator_threads: anyio.CapacityLimiter = field(init=False)
    tasks_changed: TaskSignal = field(init=False)  # wakes waiting long-polls when a round opens
    blob_cache: BlobCache = field(init=False)  # models being downloaded, read once for every site
    upload_sessions: UploadSessions = field(init=False)  # updates arriving in chunks (routes/upload_sessions.py)
    downloads: DownloadsUnderWay = field(init=False)  # sites' model downloads under way, for the status

    def __post_init__(self) -> None:
        spares = self.blob_store if isinstance(self.blob_store, FileBlobStore) else None  # recycled, as uploads do
        self.upload_sessions = UploadSessions(self._shared_dir("sessions", "upload-sessions"), spares)
        self.downloads = DownloadsUnderWay(self._shared_dir("downloads", "downloads"))
        self.upload_slots = anyio.CapacityLimiter(self.settings.upload_slots)
        self.operator_threads = anyio.CapacityLimiter(self.settings.operator_threads)
        self.blob_cache = BlobCache(self.settings.download_cache_bytes)
        # A round closed in this process hands theta^g_t to the cache (coordinator.rounds.closing).
        self.sessions.configure(info={**self.sessions.kw.get("info", {}), DOWNLOAD_CACHE: self.blob_cache})
        self.tasks_changed = TaskSignal()
        self.tasks_changed.watch(self.sessions)

    def _shared_dir(self, in_store: str, in_spool: str) -> PathOf:
        """A folder every worker shares: `in_store` in the blob store, else `cardiofl-<in_spool>-<db>` in the spool.

        Upload sessions sit in the blob store when there is one: a finished session is renamed into place.
        """
        if isinstance(self.blob_store, FileBlobStore):
            return self.blob_store.root / in_store
        spool = self.settings.upload_spool_dir or tempfile.gettempdir()
        database = hashlib.sha256(self.settings.database_url.encode()).hexdigest()[:16]
        return PathOf(spool) / f"cardiofl-{in_spool}-{database}"

    def reading_session(self) -> Session:
        """A session whose transactions only read: they take no write lock (coordinator.db.reading)."""
        return self.sessions(bind=reading(self.engine))


async def get_state(request: Request) -> AppState:
    """The app's state, built by create_app (async: a plain function would cost a trip to a request thread)."""
    return cast(AppState, request.app.state.coordinator)  # Starlette's app.state is untyped


StateDep = Annotated[AppState, Depends(get_state)]


READING_METHODS = frozenset({"GET", "HEAD"})


def get_session(request: Request, state: StateDep) -> Iterator[Session]:
    """A session for the request; it begins a transaction only when first used, and close() rolls back.

    A GET or HEAD only reads: its session's transactions take no write lock (`reading`), so on SQLite
    the sites' polls and downloads never queue behind a writer, and a write there is refused.
    """
    with state.reading_session() if request.method in READING_METHODS else state.sessions() as session:
        yield session


# Closed by a sync route itself as it returns (coordinator.api.session_routes; FastAPI would close it only
# after another trip to the request threads), by an async one before its response is sent: the connections
# in use never outnumber the threads running routes.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def _authenticate(request: Request, state: AppState) -> Principal:
    """The caller behind `Authorization: Bearer <token>`, looked up in a short session of its own.

    The lookup takes no write lock, so a request is not held up by an upload being stored; a
    site's last_seen_at is then written at most every few seconds, in a session of its own.
    """
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("send the token as 'Authorization: Bearer <token>'")
    with state.reading_session() as session:
        caller, seen_is_due = authenticate(session, token.strip(), state.settings.admin_token)
    if seen_is_due and caller.site_id is not None:
        with state.sessions() as session:
            mark_seen(session, caller.site_id)
    return caller


def route_access(request: Request) -> Access | None:
    """The entry of ROUTES for the request's method and path (below the app's root path)."""
    path: str = request.scope["path"]
    return access_for(request.method, path.removeprefix(request.scope.get("root_path", "")))


async def authorize(request: Request, state: StateDep) -> Principal | None:
    """The caller, admitted by the route's entry in ROUTES; None on a route open to every caller.

    create_app makes this a dependency of every route, so no route chooses its roles itself, and a
    route without an entry is refused to everyone. The caller is kept on the request
    (`request.state.caller`) for the audit of a refusal. The token is looked up in a request thread:
    on a route that sites may call one of the default ones, else one of the operators' (AppState).
    """
    access = route_access(request)
    if access is None:
        raise Forbidden(f"{request.method} {request.url.path} has no entry in the table of roles")
    if access.roles == NO_TOKEN:
        return None
    lane = None if Role.SITE in access.roles else state.operator_threads  # sites' traffic stays out of it
    caller = await anyio.to_thread.run_sync(_authenticate, request, state, limiter=lane)
    request.state.caller = caller
    caller.require(*access.roles)
    if caller.role is Role.SITE:
        require_agent_protocol(request.headers.get(PROTOCOL_HEADER))
    return caller


def require_agent_protocol(sent: str | None) -> int:
    """The protocol version a site agent sent; AgentTooOld when this coordinator no longer serves it.

    Agents of cardiofl 0.1 send no version: they speak protocol 1. A header that is no number is
    no version this coordinator serves either.
    """
    value = "1" if sent is None else sent.strip()
    version = int(value) if value.isascii() and value.isdigit() and len(value) < 6 else 0
    if version < MIN_PROTOCOL_VERSION:
        raise AgentTooOld(
            f"this coordinator serves site agents of protocol {MIN_PROTOCOL_VERSION} or newer; this agent "
            f"sent {PROTOCOL_HEADER}: {value[:20]!r}: upgrade the site agent (cardiofl) to the coordinator's release"
        )
    return version


async def current_caller(caller: Annotated[Principal | None, Depends(authorize)]) -> Principal:
    """The admitted caller of a route that takes a token."""
    if caller is None:
        raise LookupError("a route open to every caller has no caller; ROUTES must name its roles")
    return caller


Caller = Annotated[Principal, Depends(current_caller)]

MAX_ID = 2**31 - 1  # the largest id or round number the database's INTEGER columns hold (PostgreSQL: 32 bits)
Id = Annotated[int, Path(ge=0, le=MAX_ID, description="An id or a round number (0 to 2^31 - 1).")]


class IdSegment(Convertor[str]):
    """A path segment `{name:id}` that reads as an integer, so `/tokens/me` is no token id; Id checks its range."""

    regex = "-?[0-9]+"  # a negative or oversized number still reaches the route: 422, as on every id

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return str(value)


register_url_convertor("id", IdSegment())


def round_participant(round_id: Id, site: Caller, state: StateDep) -> Principal:
    """The calling site if it was selected for the round: else 403 `not_a_participant`, for no such round too.

    A dependency, which FastAPI resolves before it validates the route's body: a site not selected
    learns nothing of the round (whether it exists, whether it is secure) nor of what the route takes
    (a 422 naming its fields). Only a body that is not JSON at all is refused first (422), as on every
    route, even before the token is looked at. An update's body is read only once this has passed (the
    upload route depends on it).
    """
    with state.reading_session() as session:  # a read of its own, which takes no write lock
        participants = session.scalar(select(Round.participants).where(Round.id == round_id))
    if participants is None or site.site_name not in participants:
        raise NotAParticipant.of_round(site.site_name, round_id)
    return site


Participant = Annotated[Principal, Depends(round_participant)]

UPDATE_MEDIA_TYPES = {"application/octet-stream", "application/vnd.safetensors", ""}
# The OpenAPI entry of a route whose body is raw safetensors bytes (an update, `ModelBody`).
RAW_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


async def read_model_body(request: Request, state: StateDep, _caller: Caller) -> AsyncIterator[IncomingBlob]:
    """A model file's raw safetensors body, spooled (`spooled_body`) once the caller is admitted."""
    settings = state.settings
    limit = min(settings.max_model_file_bytes, settings.max_upload_bytes or settings.max_model_file_bytes)
    async with spooled_body(request, state, limit) as spool:
        yield spool


@asynccontextmanager
async def spooled_body(request: Request, state: AppState, limit: int) -> AsyncIterator[IncomingBlob]:
    """The raw body, spooled to a file as it arrives (hashed on the way), at most `limit` bytes.

    With a blob store the file is in the store's own directory, so an accepted update is renamed into
    place rather than copied; else it is in the upload spool directory. No upload waits in memory.
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in UPDATE_MEDIA_TYPES:
        raise UnsupportedMediaType(f"send the body as application/octet-stream, not {media_type!r}")
    header = request.headers.get("content-length", "")
    declared = int(header) if header.isdigit() else 0  # 0: not said (chunked), or not a number
    if declared > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the {limit}-byte limit")
    if state.blob_store is not None:
        spool = state.blob_store.incoming(declared)
    else:
        spool = IncomingBlob(state.settings.upload_spool_dir or tempfile.gettempdir(), named=False)
    with spool:
        await _spool(request, spool, limit)
        yield spool


SPOOL_BATCH_BYTES = 1 << 20  # received bytes handed to a thread at once to be written and hashed


async def _spool(request: Request, spool: IncomingBlob, limit: int) -> None:
    """Write the body into `spool` in a worker thread, a batch at a time, while the event loop receives the next.

    Hashing and writing (about 1.7 GB/s for sha256) then run beside the loop, which goes on serving
    other sites, instead of on it.
    """
    loop = asyncio.get_running_loop()
    received, batch, batch_bytes = 0, [], 0
    writing: asyncio.Future[None] | None = None
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
            batch.append(chunk)
            batch_bytes += len(chunk)
            if batch_bytes >= SPOOL_BATCH_BYTES:
                if writing is not None:
                    await writing
                writing = loop.run_in_executor(None, spool.write_all, batch)
                batch, batch_bytes = [], 0
        if writing is not None:
            await writing
        writing = loop.run_in_executor(None, spool.write_all, batch, True)
        await writing
    finally:
        if writing is not None and not writing.done():  # the file must not close under the thread
            await asyncio.wait([writing])


ModelBody = Annotated[IncomingBlob, Depends(read_model_body)]
