"""Stored updates added to an average straight from the blob store or database, window by window, never whole."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy import Engine

from coordinator.storage.blobs import open_blobs
from coordinator.storage.stored_tensors import blob_header
from coordinator.storage.update_files import BlobStore
from shared.algorithms.aggregation import AlignedPiece, WeightedAverage
from shared.tensors.codec import Header
from shared.tensors.windows import PIECE_BYTES, Window, payload_order, payload_windows, read_window, window_views

__all__ = ["GROUP", "WORKERS", "add_stored_updates", "stored_headers"]

GROUP = 8  # updates read side by side, so that a window of each is summed while it is in the CPU caches
WORKERS = 2  # threads that each read and sum a contiguous share of the windows
SHARE_BYTES = 32 << 20  # a worker's share is at least this much data: less is not worth a thread
PREFETCH_BYTES = PIECE_BYTES  # PostgreSQL: one query per window of each update (4 MiB fetches were no faster)


def add_stored_updates(
    average: WeightedAverage,
    engine: Engine,
    digests: Sequence[str],
    weights: Sequence[float],
    *,
    group: int = GROUP,
    workers: int = WORKERS,
    store: BlobStore | None = None,
) -> None:
    """Add the stored updates (safetensors blobs) `digests` to `average`, update k with weight `weights[k]`.

    Updates of one layout are read side by side, `group` at a time: a window of the data section
    is read from each of them and summed at once, so the sums are read and written once per group
    rather than once per update. Up to `workers` threads (one per SHARE_BYTES of the group's data)
    each read and sum a contiguous share of the windows on a database connection of their own;
    reads and sums release the GIL, and coordinator.db says why a share of a blob can be found
    without reading the blob up to it. Memory stays one model (the sums) plus one window of each
    update in the group per thread, whatever the number of updates; the result is bit-identical
    to adding the updates one at a time in the order given.
    """
    if len(digests) != len(weights):
        raise ValueError(f"{len(digests)} updates but {len(weights)} weights")
    headers = _headers(engine, digests, store)
    for batch in _batches(headers, group):
        order = payload_order(headers[batch[0]])
        with average.adding(headers[batch[0]].specs, [weights[k] for k in batch], order) as accumulate:
            windows = payload_windows(
                headers[batch[0]], run_key=average.run_key if average.lays_out_like(order) else None
            )
            share = _Share(engine, [(digests[k], headers[k]) for k in batch], accumulate, store)
            batch_bytes = (windows[-1].stop if windows else 0) * len(batch)
            threads = max(1, min(workers, batch_bytes // SHARE_BYTES))
            parts = [windows[i * len(windows) // threads : (i + 1) * len(windows) // threads] for i in range(threads)]
            if threads == 1:
                share.add(parts[0])
            else:
                with ThreadPoolExecutor(threads, thread_name_prefix="aggregate") as pool:
                    list(pool.map(share.add, parts))


def stored_headers(engine: Engine, digests: Sequence[str], store: BlobStore | None = None) -> list[Header]:
    """The parsed safetensors header (specs and metadata) of every stored update `digests`."""
    return _headers(engine, digests, store)


def _headers(engine: Engine, digests: Sequence[str], store: BlobStore | None) -> list[Header]:
    """The parsed header of every stored update, one blob open at a time (a stored file maps its first block)."""
    headers = []
    for digest in digests:
        with open_blobs(engine, [digest], prefetch=0, store=store) as (blob,):
            headers.append(blob_header(blob))
    return headers


@dataclass(frozen=True)
class _Share:
    """Reads windows of updates of one layout and accumulates them, on a connection of its own per call."""

    engine: Engine
    updates: list[tuple[str, Header]]  # (digest, header)
    accumulate: Callable[[Iterable[AlignedPiece]], None]
    store: BlobStore | None

    def add(self, windows: list[Window]) -> None:
        """Read `windows` of every update and accumulate them, a window at a time."""
        if not windows:
            return
        digests = [digest for digest, _ in self.updates]
        with open_blobs(self.engine, digests, prefetch=PREFETCH_BYTES, store=self.store) as blobs:
            for window in windows:
                buffers = [
                    read_window(header, window, blob.read)
                    for (_, header), blob in zip(self.updates, blobs, strict=True)
                ]
                self.accumulate(window_views(window, buffers))


def _batches(headers: Sequence[Header], size: int) -> Iterator[list[int]]:
    """Indices of neighbouring headers of one layout (specs and byte offsets), at most `size` at a time."""
    batch: list[int] = []
    for index, header in enumerate(headers):
        if batch and (len(batch) == size or not _same_layout(headers[batch[0]], header)):
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


def _same_layout(first: Header, second: Header) -> bool:
    return first.specs == second.specs and first.offsets == second.offsets
