"""An update whose upload was cut resumes from the bytes the coordinator holds: upload sessions.

An agent sends its update as always, `POST .../updates`, naming its sha256 (`Upload-Sha256`). The
coordinator then spools it into the site's session of that update, a file that outlives the request:
a connection cut mid-body leaves the bytes that arrived there. `GET .../updates/sessions/{sha256}`
answers how many it holds (once a chunk still arriving has ended), and `PATCH` on it appends a chunk
that starts exactly there (`Upload-Offset`, else 409 with the offset held). Once the last byte is in,
the whole is checked against the announced sha256 and accepted exactly as one request's body is
(routes/updates.py `accept_spooled`). A POST without the header is spooled and accepted as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, BackgroundTasks, Path, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session
from starlette.requests import ClientDisconnect

from coordinator.api.deps import RAW_BODY, UPDATE_MEDIA_TYPES, AppState, Id, Participant, SessionDep, StateDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.errors import (
    CoordinatorError,
    InvalidUpload,
    NotFound,
    OffsetMismatch,
    PayloadTooLarge,
    Unprocessable,
    UnsupportedMediaType,
)
from coordinator.rounds.buffered import uploadable_rounds
from coordinator.rounds.closing import close_round_if_ready
from coordinator.rounds.updates import accept_update, admit_upload_session, record_upload_refusal, upload_limit
from coordinator.sites.security import Principal
from coordinator.storage.update_files import IncomingBlob
from coordinator.storage.upload_sessions import SessionBusy, SessionFile, SessionKey
from shared.wire.protocol import (
    UPLOAD_OFFSET_HEADER,
    UPLOAD_SHA256_HEADER,
    ErrorBody,
    UpdateReceipt,
    UploadSessionView,
)

__all__ = ["accept_spooled", "receive_announced", "round_upload_limit", "router", "sweep_upload_sessions"]

router = APIRouter(prefix="/rounds", tags=["site"], route_class=SessionReleasingRoute)

SESSION = "/{round_id}/updates/sessions/{sha256}"
CHUNK_MEDIA_TYPES = UPDATE_MEDIA_TYPES | {"application/offset+octet-stream"}
OFFSET_WAIT_S = 10.0  # how long a GET waits for a chunk still arriving (a cut one) to end before it answers
WRITE_BATCH_BYTES = 1 << 20  # received bytes handed to a thread at once to be written
SHA256_PATTERN = r"^[0-9a-f]{64}$"
Digest = Annotated[str, Path(pattern=SHA256_PATTERN, description="the sha256 the update was sent with")]


_GONE: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "upload_session_not_found: none of these bytes (finished, swept)"}
}


@router.get(SESSION, responses={200: {"model": UploadSessionView}, **_GONE})
def read_upload_session(
    round_id: Id, sha256: Digest, request: Request, site: Participant, state: StateDep
) -> JSONResponse:
    """The bytes the coordinator holds of a cut upload (once a chunk still arriving has ended); 404 when none."""
    key = _session(state, round_id, site, sha256)
    offset = state.upload_sessions.offset(key, wait_s=OFFSET_WAIT_S)
    if offset < 0:
        raise _no_session(round_id, sha256)
    view = UploadSessionView(url=request.url.path, offset=offset, size=key.size, sha256=sha256)
    return JSONResponse(view.model_dump(mode="json"), headers={UPLOAD_OFFSET_HEADER: str(offset)})


@router.patch(
    SESSION,
    status_code=204,
    responses={
        204: {"description": "the chunk is held; `Upload-Offset` is where the next one starts"},
        201: {"model": UpdateReceipt, "description": "the last chunk: the update is accepted, its receipt"},
        200: {"model": UpdateReceipt, "description": "the last chunk of bytes accepted before: the first receipt"},
        **_GONE,
    },
    openapi_extra=RAW_BODY,
)
async def append_upload_chunk(
    round_id: Id,
    sha256: Digest,
    request: Request,
    site: Participant,
    state: StateDep,
    session: SessionDep,
    later: BackgroundTasks,
) -> Response:
    """Append the chunk that starts at header `Upload-Offset`; after the last byte, check and store the update."""
    asked = request.headers.get(UPLOAD_OFFSET_HEADER, "").strip()
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in CHUNK_MEDIA_TYPES:
        raise UnsupportedMediaType(f"send the chunk as application/offset+octet-stream, not {media_type!r}")
    key = _session(state, round_id, site, sha256)
    with _locked(state, key) as file:
        if not asked.isascii() or not asked.isdigit() or int(asked) != file.offset:
            raise OffsetMismatch(f"this session holds {file.offset} bytes: send the chunk from there", file.offset)
        return await _take(request, round_id, site, key, file, state, session, later)


def round_upload_limit(state: AppState, round_id: int) -> int:
    """The largest update body round `round_id` takes (coordinator.rounds.updates.upload_limit), read on its own."""
    with state.reading_session() as session:
        return upload_limit(session, round_id, state.settings.max_upload_bytes)


async def receive_announced(
    request: Request,
    round_id: int,
    site: Principal,
    state: AppState,
    session: Session,
    later: BackgroundTasks,
    *,
    limit: int,
) -> Response:
    """A POSTed update sent with its sha256 (`Upload-Sha256`): spooled into its session, kept there if cut."""
    assert site.site_id is not None
    digest = request.headers.get(UPLOAD_SHA256_HEADER, "").strip().lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise Unprocessable(f"{UPLOAD_SHA256_HEADER} must be the update's sha256 in hex", code="invalid_request")
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in UPDATE_MEDIA_TYPES:
        raise UnsupportedMediaType(f"send the body as application/octet-stream, not {media_type!r}")
    size = int(request.headers["content-length"])
    if size > limit:
        raise PayloadTooLarge(f"body of {size} bytes exceeds the {limit}-byte limit")
    try:
        receipt = await anyio.to_thread.run_sync(
            lambda: admit_upload_session(session, round_id=round_id, site=site, digest=digest)
        )
    except CoordinatorError:  # refused as a whole body is, once it has arrived: the agent reads the answer
        await _drain(request)
        raise
    if receipt is not None:  # these bytes were accepted already: the first receipt, as for a whole body
        await _drain(request)
        return JSONResponse(receipt.model_dump(mode="json"), status_code=200)
    key = SessionKey(round_id, site.site_id, size, digest)
    state.upload_sessions.start(key)
    with _locked(state, key) as file:
        if file.offset:
            raise OffsetMismatch(f"this update's session holds {file.offset} bytes: send the rest", file.offset)
        return await _take(request, round_id, site, key, file, state, session, later)


async def _drain(request: Request) -> None:
    """Read the rest of the body and drop it."""
    async for _ in request.stream():
        pass


async def _take(
    request: Request,
    round_id: int,
    site: Principal,
    key: SessionKey,
    file: SessionFile,
    state: AppState,
    session: Session,
    later: BackgroundTasks,
) -> Response:
    """Receive the body into the session; once it holds every byte, check and store the update.

    A session that this request fills from its first byte is hashed as the bytes arrive; one that
    resumes is read back whole at the end.
    """
    try:
        hashes = IncomingBlob.over(file.path) if file.offset == 0 else None
    except FileNotFoundError:  # swept since it was locked (its round closed)
        raise _no_session(round_id, key.sha256) from None
    try:
        complete = await _receive(request, file, hashes)
    except BaseException:
        if hashes is not None:
            hashes.close()
        raise
    if complete:
        return await _finish(round_id, site, key, state, session, later, hashes)
    if hashes is not None:
        hashes.close()
    return Response(status_code=204, headers={UPLOAD_OFFSET_HEADER: str(file.offset)})


def _session(state: AppState, round_id: int, site: Principal, sha256: str) -> SessionKey:
    assert site.site_id is not None
    key = state.upload_sessions.find(round_id, site.site_id, sha256)
    if key is None:
        raise _no_session(round_id, sha256)
    return key


def _no_session(round_id: int, sha256: str) -> NotFound:
    return NotFound(
        f"round {round_id} has no upload session of {sha256[:12]} for this site (finished, swept or never started)",
        code="upload_session_not_found",
    )


@contextlib.contextmanager
def _locked(state: AppState, key: SessionKey) -> Iterator[SessionFile]:
    """The session's file for this request alone; 409 upload_session_busy while another chunk arrives."""
    try:
        with state.upload_sessions.writing(key) as file:
            yield file
    except SessionBusy:
        held = state.upload_sessions.offset(key, wait_s=0.0)
        raise OffsetMismatch(
            f"another chunk of this session is arriving; it holds {held} bytes so far", held, code="upload_session_busy"
        ) from None
    except FileNotFoundError:
        raise _no_session(key.round_id, key.sha256) from None


async def _receive(request: Request, file: SessionFile, hashes: IncomingBlob | None) -> bool:
    """Append the body to `file` (and to `hashes`) as it arrives, keeping what came before a cut; whether complete."""
    batch: list[bytes] = []
    pending = 0
    try:
        async for chunk in request.stream():
            if file.offset + pending + len(chunk) > file.size:
                raise PayloadTooLarge(f"the chunk goes past the {file.size} bytes the session announced")
            batch.append(chunk)
            pending += len(chunk)
            if pending >= WRITE_BATCH_BYTES:
                await anyio.to_thread.run_sync(_append, file, batch, False, hashes)
                batch, pending = [], 0
    except ClientDisconnect:
        await anyio.to_thread.run_sync(_append, file, batch, True, hashes)  # the bytes that arrived are held
        raise
    await anyio.to_thread.run_sync(_append, file, batch, True, hashes)
    return file.offset == file.size


def _append(file: SessionFile, batch: list[bytes], sync: bool, hashes: IncomingBlob | None) -> None:
    for chunk in batch:
        file.append(chunk)
        if hashes is not None:
            hashes.write_hashes(chunk)
    if sync:
        file.sync()


async def _finish(
    round_id: int,
    site: Principal,
    key: SessionKey,
    state: AppState,
    session: Session,
    later: BackgroundTasks,
    hashes: IncomingBlob | None = None,
) -> Response:
    """The session's whole, hashed (as it arrived, or now), checked against its sha256, accepted as a body is."""
    path = state.upload_sessions.path(key)
    try:
        blob = hashes if hashes is not None else await anyio.to_thread.run_sync(IncomingBlob.of_file, path)
    except FileNotFoundError:
        raise _no_session(round_id, key.sha256) from None
    if hashes is not None:
        await anyio.to_thread.run_sync(hashes.finish)
    with blob:  # the session's file goes afterwards, whatever the outcome (renamed into the store if accepted)
        if blob.sha256 != key.sha256:
            message = f"the session's {blob.size} bytes have sha256 {blob.sha256}, not the announced {key.sha256}"
            await anyio.to_thread.run_sync(
                record_upload_refusal, state.sessions, site, round_id, "digest_mismatch", message
            )
            raise InvalidUpload(message, code="digest_mismatch")
        return await accept_spooled(round_id, site, blob, state, session, later)


async def accept_spooled(
    round_id: int, site: Principal, body: IncomingBlob, state: AppState, session: Session, later: BackgroundTasks
) -> JSONResponse:
    """Check and store a spooled update (one request's body, or an upload session's whole): its receipt, 201 or 200."""
    # In one of upload_slots' threads: an upload waiting for a slot holds none of the threads other requests run in.
    receipt, created = await anyio.to_thread.run_sync(
        _accept, round_id, site, body, state, session, limiter=state.upload_slots
    )
    if created:  # maybe the last expected update: close the round it joined after answering
        later.add_task(
            close_round_if_ready,
            state.sessions,
            receipt.round_id,
            now=utc_now(),
            lease_s=state.settings.aggregation_lease_s,
        )
    return JSONResponse(receipt.model_dump(mode="json"), status_code=201 if created else 200)


def _accept(
    round_id: int, site: Principal, body: IncomingBlob, state: AppState, session: Session
) -> tuple[UpdateReceipt, bool]:
    with body.mapped() as data:
        return accept_update(
            session,
            round_id=round_id,
            site=site,
            body=data,
            max_num_examples=state.settings.max_num_examples,
            now=utc_now(),
            digest=body.sha256,
            incoming=body,
        )


def sweep_upload_sessions(state: AppState) -> int:
    """Remove upload sessions untouched for upload_session_ttl_s, or whose round takes no update now.

    A buffered study's released rounds still take updates (they join the open buffer).

    Also the download markers of workers that died mid-download (coordinator.storage.download_progress).
    """
    with state.reading_session() as session:
        open_rounds = uploadable_rounds(session)
    state.downloads.sweep()
    return state.upload_sessions.sweep(older_than_s=state.settings.upload_session_ttl_s, open_rounds=open_rounds)
