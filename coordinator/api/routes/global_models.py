"""Global models of a study as streamed safetensors downloads, ETag = sha256, 304 when the client has them.

A `Range` request gets those bytes (206), so a site resumes a cut download (coordinator.api.byte_ranges).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.api.byte_ranges import DownloadConditions, download_conditions, requested_range
from coordinator.api.deps import AppState, Caller, Id, SessionDep, StateDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.errors import NotAParticipant, NotFound
from coordinator.models import Blob, GlobalModel, Role, Study
from coordinator.sites.security import Principal
from coordinator.storage.blob_parts import Buffer
from coordinator.storage.blobs import CHUNK_BYTES, blob_chunks
from coordinator.storage.download_progress import DownloadKey
from coordinator.studies import lifecycle as studies
from coordinator.studies.views import global_models
from shared.wire.api import GlobalModelPublic, Page

router = APIRouter(prefix="/studies/{study_id}/models", tags=["models"], route_class=SessionReleasingRoute)

SAFETENSORS: dict[int | str, dict[str, object]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "safetensors bytes"},
    206: {"content": {"application/octet-stream": {}}, "description": "the bytes of the Range, with Content-Range"},
    304: {"description": "If-None-Match names the model's ETag (or *): the client's copy is current"},
    416: {"description": "the Range names no bytes of the model"},
}
Conditions = Annotated[DownloadConditions, Depends(download_conditions)]


def _may_download(session: Session, study_id: int, caller: Principal) -> None:
    """A site downloads only the models of its own studies (ROUTES admits the roles).

    A site asking for a study it is not part of is refused alike whether or not the study exists
    (403 not_a_participant); anyone else is told 404 for a study that does not exist.
    """
    if caller.role is not Role.SITE:
        studies.get_study(session, study_id)
        return
    study = session.get(Study, study_id)
    if study is None or caller.site_name not in study.terms.listed_sites:
        raise NotAParticipant.of_study(caller.site_name, study_id)


def _blob_response(
    state: AppState, digest: str, size: int, asked: DownloadConditions, filename: str, follow: DownloadKey | None = None
) -> Response:
    """The blob (or the range asked for) streamed in chunks: from the download cache, or read a chunk at a time.

    `follow`: a site's download, whose bytes sent so far the status shows (coordinator.storage.download_progress).
    """
    etag = f'"{digest}"'
    presented = {tag.strip().removeprefix("W/") for tag in (asked.if_none_match or "").split(",")}
    if etag in presented or digest in presented or "*" in presented:
        return Response(status_code=304, headers={"ETag": etag})
    part = requested_range(asked, etag, size)
    start, end = (part.start, part.end) if part is not None else (0, size)
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Length": str(end - start),
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    if part is not None:
        headers["Content-Range"] = part.content_range
    data = state.blob_cache.get(state.engine, digest, size)  # nothing is held while the chunks travel
    chunks = _slices(data, start, end) if data is not None else blob_chunks(state.engine, digest, end, start=start)
    return StreamingResponse(
        chunks if follow is None else state.downloads.tracked(chunks, follow, start),
        status_code=200 if part is None else 206,
        media_type="application/octet-stream",
        headers=headers,
    )


async def _slices(data: Buffer, start: int = 0, end: int | None = None) -> AsyncIterator[memoryview]:
    """`data[start:end]` a chunk at a time, as views: nothing is copied before the socket."""
    view = memoryview(data)[start:end]
    for offset in range(0, len(view), CHUNK_BYTES):
        yield view[offset : offset + CHUNK_BYTES]


def _global_model(session: Session, study_id: int, number: int) -> GlobalModel:
    model = session.scalar(
        select(GlobalModel).where(GlobalModel.study_id == study_id, GlobalModel.round_number == number)
    )
    if model is None:
        raise NotFound(f"no global model of round {number} in study {study_id}")
    return model


@router.get("")
def read_models(study_id: Id, session: SessionDep) -> Page[GlobalModelPublic]:
    """Every stored theta^g_t of the study, with digests and sizes."""
    studies.get_study(session, study_id)
    models = global_models(session, study_id)
    return Page(data=models, count=len(models))


def _download(
    state: AppState, study_id: int, number: int, caller: Principal, local: bool, asked: DownloadConditions
) -> Response:
    """The model's (or, `local`, round 0's phi_0) response, read in one session in one trip to a request thread."""
    with state.reading_session() as session:
        _may_download(session, study_id, caller)
        model = _global_model(session, study_id, number)
        digest = model.local_sha256 if local else model.sha256
        if digest is None:
            raise NotFound(f"only round 0 publishes local tensors, not round {number}")
        size = session.scalar(select(Blob.size).where(Blob.sha256 == digest))
    if size is None:
        raise NotFound(f"blob {digest}")
    name = "initial-local" if local else f"global-{number}"
    follow = DownloadKey(study_id, number, caller.site_id, size) if caller.site_id is not None and not local else None
    return _blob_response(state, digest, size, asked, f"study{study_id}-{name}.safetensors", follow)


@router.get("/{number}", responses=SAFETENSORS, response_class=Response)
async def download_global_model(
    study_id: Id, number: Id, caller: Caller, state: StateDep, asked: Conditions
) -> Response:
    """theta^g_t after round `number` (0: the seeded initial model), as safetensors, or a Range of it (206)."""
    return await run_in_threadpool(_download, state, study_id, number, caller, False, asked)


@router.get("/{number}/local", responses=SAFETENSORS, response_class=Response)
async def download_initial_local(
    study_id: Id, number: Id, caller: Caller, state: StateDep, asked: Conditions
) -> Response:
    """phi_0, the untrained local tensors of round 0 (only round 0 has them), or a Range of it."""
    return await run_in_threadpool(_download, state, study_id, number, caller, True, asked)
