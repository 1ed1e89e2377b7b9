"""Model files a researcher uploads (POST /api/v1/models): safetensors stored by digest, for an evaluate study to name.

A model file is any well-formed safetensors payload of finite tensors; it is kept in the database beside
the global models (coordinator/storage/blobs.py), content addressed, so the same bytes again are the same
model. Which tensors it must hold is decided when an evaluate study names it by its digest, against that
study's terms (coordinator/studies/job_kinds.py). A study may name a model file or a global model, never a
site's update: `model_header` does not find those.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.errors import InvalidUpload
from coordinator.models import Blob, BlobLocation, Update
from coordinator.storage.blobs import open_blob, put_blob
from coordinator.storage.stored_tensors import blob_header
from shared.tensors.codec import Header, PayloadError, check_finite, read_header, tensor_views
from shared.wire.api import ModelUploaded

__all__ = ["model_header", "store_model"]


def store_model(session: Session, data: memoryview, digest: str, *, actor: str) -> ModelUploaded:
    """Check and store a model file's bytes (whose sha256 is `digest`), audited; InvalidUpload naming a refusal."""
    try:
        header = read_header(data)
        check_finite(tensor_views(data, header))
    except PayloadError as exc:
        raise InvalidUpload(f"not a model file of finite tensors: {exc}", code=exc.code) from None
    put_blob(session, data, digest)
    stored = ModelUploaded(sha256=digest, size=len(data), tensors=len(header.specs))
    audit.record(session, "model.uploaded", actor=actor, digest=digest, size=stored.size, tensors=stored.tensors)
    session.commit()
    return stored


def model_header(session: Session, digest: str) -> Header | None:
    """The safetensors header of the model blob `digest`; None when the database holds no such model.

    A site's update is no model, even where it is kept in the database: a study naming its digest must
    not make it downloadable as the study's model.
    """
    kept = session.scalar(
        select(Blob.size).where(
            Blob.sha256 == digest,
            Blob.location == BlobLocation.DATABASE,
            ~select(Update.id).where(Update.sha256 == digest).exists(),
        )
    )
    if kept is None:
        return None
    with open_blob(session, digest, prefetch=0) as blob:
        return blob_header(blob)
