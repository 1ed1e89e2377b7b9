"""A researcher's model files: safetensors bytes stored by their sha256, which an evaluate study's terms then name."""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from sqlalchemy.orm import Session

from coordinator.api.deps import RAW_BODY, Caller, ModelBody, SessionDep, StateDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.storage.model_files import store_model
from coordinator.storage.update_files import IncomingBlob
from shared.wire.api import ModelUploaded

router = APIRouter(prefix="/models", tags=["models"], route_class=SessionReleasingRoute)


@router.post("", status_code=201, openapi_extra=RAW_BODY)
async def upload_model(researcher: Caller, body: ModelBody, state: StateDep, session: SessionDep) -> ModelUploaded:
    """Store a model's tensors (theta^g or phi_0) as safetensors: 201 with their sha256, the same for the same bytes.

    Bytes that are not safetensors, or hold NaN or Inf, are refused (422 `malformed_payload`,
    `non_finite_values`); which tensors they must hold is checked when a study names them (422
    `model_not_of_terms`).
    """
    return await anyio.to_thread.run_sync(_store, body, session, researcher.actor, limiter=state.upload_slots)


def _store(body: IncomingBlob, session: Session, actor: str) -> ModelUploaded:
    with body.mapped() as data:
        return store_model(session, data, body.sha256, actor=actor)
