"""What the blob store keeps: an update's file only while a round may still read it, unless its study keeps them.

An uploaded update is needed until its round is settled (completed, failed or cancelled); after
that only its digest, size and metrics matter, and those stay in the database and the audit log.
`release_updates` removes the files of settled rounds (the blob's row says `released`), except
for studies created with `keep_updates = true`. A file shared by several updates (equal bytes)
goes only when every round that holds it is settled. `sweep_store` removes what a crash left:
partial uploads, and files that no row claims; and spare files no upload reused within the hour.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from coordinator.models import Blob, BlobLocation, Round, RoundStatus, Study, Update
from coordinator.storage.blobs import blob_store_of
from coordinator.storage.update_files import FileBlobStore

__all__ = ["SETTLED", "release_updates", "sweep_store", "tidy_store"]

log = logging.getLogger(__name__)

SETTLED = (RoundStatus.COMPLETED, RoundStatus.FAILED, RoundStatus.CANCELLED)


def release_updates(session: Session, *, round_ids: Iterable[int] | None = None) -> int:
    """Remove the stored files of the updates of settled rounds (of `round_ids`, or all); returns how many.

    Runs in one write transaction of `session` (none may be open) that first locks the blobs' rows,
    so an upload of equal bytes (coordinator.storage.blobs.put_update_blob) is stored wholly before or after.
    """
    store = blob_store_of(session)
    if store is None:
        return 0
    query = select(Update.sha256).join(Blob, Blob.sha256 == Update.sha256).where(Blob.location == BlobLocation.STORE)
    if round_ids is not None:
        query = query.where(Update.round_id.in_(list(round_ids)))
    candidates = sorted(set(session.scalars(query)))
    if not candidates:
        session.rollback()
        return 0
    locked = select(Blob.sha256).where(Blob.sha256.in_(candidates), Blob.location == BlobLocation.STORE)
    if session.get_bind().dialect.name == "postgresql":
        locked = locked.with_for_update()
    candidates = sorted(session.scalars(locked))  # SQLite: the transaction holds the write lock already
    releasable = _unneeded(session, candidates)
    for digest in releasable:
        store.delete(digest)
    if releasable:
        session.execute(
            update(Blob)
            .where(Blob.sha256.in_(releasable), Blob.location == BlobLocation.STORE)
            .values(location=BlobLocation.RELEASED)
        )
    session.commit()
    if releasable:
        log.info("released %d stored update(s) of settled rounds", len(releasable))
    return len(releasable)


def _unneeded(session: Session, digests: list[str]) -> list[str]:
    """The digests among `digests` that no unsettled round and no study keeping its updates holds."""
    rows = session.execute(
        select(Update.sha256, Round.status, Study.terms)
        .join(Round, Update.round_id == Round.id)
        .join(Study, Round.study_id == Study.id)
        .where(Update.sha256.in_(digests))
    ).all()
    needed = {digest for digest, status, terms in rows if status not in SETTLED or terms.keep_updates}
    return [digest for digest in digests if digest not in needed]


def tidy_store(sessions: sessionmaker[Session]) -> int:
    """Release what settled rounds still hold (a crash between settling and releasing) and sweep; how many went."""
    with sessions() as session:
        released = release_updates(session)
    return released + sweep_store(sessions)


def sweep_store(sessions: sessionmaker[Session], *, older_than_s: float = 3600.0) -> int:
    """Remove partial uploads, files no row claims and spares, untouched for `older_than_s`; returns how many.

    A crash can leave either: an upload cut off while it arrived, or one renamed into place by a
    transaction that never committed. The age keeps uploads in flight out of reach.
    """
    with sessions() as session:
        store = blob_store_of(session)
        if not isinstance(store, FileBlobStore):
            return 0
        claimed = set(session.scalars(select(Blob.sha256).where(Blob.location == BlobLocation.STORE)))
        session.rollback()
    removed = store.sweep_incoming(older_than_s) + store.sweep_spares(older_than_s)
    cutoff = time.time() - older_than_s
    for digest in store.digests():
        if digest in claimed:
            continue
        path = store.path(digest)
        try:
            if os.stat(path).st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    if removed:
        log.info("swept %d file(s) that no stored blob claims from %s", removed, store.root)
    return removed
