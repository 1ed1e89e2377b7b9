"""Stored updates added to an average straight from the database, a piece at a time, never whole in memory."""

from __future__ import annotations

from sqlalchemy.orm import Session

from coordinator.blobs import open_blob
from shared.aggregation import WeightedAverage
from shared.tensors import header_end, read_header, tensor_pieces

__all__ = ["add_stored_update"]


def add_stored_update(average: WeightedAverage, session: Session, digest: str, weight: float) -> None:
    """Add the stored update (safetensors blob) `digest` to `average` with weight `weight`.

    Each piece is read from the database into the CPU caches and summed from there, so the update
    costs one pass over its bytes and memory stays one model (the sums) whatever the number of sites.
    """
    with open_blob(session, digest) as blob:
        header = read_header(blob.read(0, header_end(blob.read(0, 8), blob.size)), blob.size)
        average.add_pieces(header.specs, tensor_pieces(header, blob.read), weight)
