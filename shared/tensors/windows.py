"""A safetensors payload read a window at a time: pieces of its tensors that stay in the CPU caches while used.

A stored payload (an update, theta^g) is never held whole: `payload_windows` cuts its data section
into windows of about PIECE_BYTES, `tensor_pieces` yields each tensor as flat pieces read one
window at a time, and `tensor_runs` groups neighbouring tensors so a consumer adds many at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from shared.tensors.codec import Buffer, Header, MalformedPayload, TensorSpec, tensor_view

__all__ = [
    "PIECE_BYTES",
    "Window",
    "payload_order",
    "payload_windows",
    "read_window",
    "tensor_pieces",
    "tensor_runs",
    "window_views",
]

PIECE_BYTES = 1 << 20  # pieces of this size stay in the CPU caches between reading and using them


def payload_order(header: Header) -> tuple[str, ...]:
    """The names of the header's tensors in the order their bytes lie in the data section."""
    return tuple(name for name, _ in sorted(header.offsets.items(), key=lambda item: item[1]))


@dataclass(frozen=True)
class Window:
    """A byte range of a payload's data section, and the flat pieces of tensors (or runs) in it."""

    start: int
    stop: int
    pieces: tuple[tuple[str, int, int, TensorSpec], ...]  # (name, first element, byte offset in the window, 1-D spec)


def payload_windows(
    header: Header, max_bytes: int | None = None, *, run_key: Callable[[str], Hashable] | None = None
) -> list[Window]:
    """The data section cut into windows of about `max_bytes` (default PIECE_BYTES), in payload order.

    Many small tensors share a window, a large one spans several, and the pieces of all windows
    cover each tensor exactly once. With `run_key`, neighbouring tensors of one dtype and one key
    form a run that is cut as if it were one tensor named after its first (see tensor_runs): a
    piece then may run on past the end of its named tensor into the next ones, so a consumer whose
    sums lie in the same order adds a window of many tensors at once. Payloads of one layout share
    their windows.
    """
    spans = _spans(header, run_key)
    begins = [begin for begin, _, _, _ in spans]
    data_len = spans[-1][1] if spans else 0
    step = max(max_bytes or PIECE_BYTES, 8)  # 8: the largest element
    windows, position = [], 0
    while position < data_len:
        stop = min(position + step, data_len)
        begin, end, _, dtype = spans[bisect.bisect_right(begins, stop) - 1]
        if begin < stop < end:  # cut at an element boundary of the span that `stop` falls into
            stop -= (stop - begin) % dtype.itemsize
        pieces = []
        for begin, end, name, dtype in spans[bisect.bisect_right(begins, position) - 1 :]:
            if begin >= stop:
                break
            first, last = max(begin, position), min(end, stop)
            spec = TensorSpec(((last - first) // dtype.itemsize,), dtype)
            pieces.append((name, (first - begin) // dtype.itemsize, first - position, spec))
        windows.append(Window(position, stop, tuple(pieces)))
        position = stop
    return windows


def read_window(header: Header, window: Window, read: Callable[[int, int], Buffer]) -> Buffer:
    """The bytes of `window` of the payload that `read(offset, size)` reads, checked for length."""
    buffer = read(header.data_start + window.start, window.stop - window.start)
    if len(buffer) != window.stop - window.start:
        raise MalformedPayload(
            f"read {len(buffer)} of {window.stop - window.start} bytes at {window.start} (truncated?)"
        )
    return buffer


def window_views(window: Window, buffers: Sequence[Buffer]) -> Iterator[tuple[str, int, tuple[Tensor, ...]]]:
    """Each piece of `window` as `(name, first element, one 1-D view per buffer)`; buffers hold its bytes."""
    for name, first, offset, spec in window.pieces:
        yield name, first, tuple(tensor_view(buffer, offset, spec) for buffer in buffers)


def tensor_pieces(
    header: Header,
    read: Callable[[int, int], Buffer],
    max_bytes: int | None = None,
    *,
    run_key: Callable[[str], Hashable] | None = None,
) -> Iterator[tuple[str, int, Tensor]]:
    """Every tensor as flat pieces `(name, index of the piece's first element, 1-D values)`, in payload order.

    `read(offset, size)` returns `size` bytes of the payload from `offset`; it is called once per
    window (see payload_windows), so a payload that is not in memory (a stored blob) is never held
    whole. The values view the buffers `read` returned: never write to them.
    """
    for window in payload_windows(header, max_bytes, run_key=run_key):
        for name, first, (values,) in window_views(window, [read_window(header, window, read)]):
            yield name, first, values


def tensor_runs(
    names: Iterable[str], specs: Mapping[str, TensorSpec], run_key: Callable[[str], Hashable] | None = None
) -> list[list[str]]:
    """The non-empty tensors of `names`, in that order, grouped into runs that share dtype and key.

    Neighbours of one dtype and one `run_key(name)` form a run; without `run_key`, each tensor is a
    run of its own.
    """
    runs: list[list[str]] = []
    previous: Hashable = None
    for name in names:
        spec = specs[name]
        if spec.numel == 0:
            continue
        key = (spec.dtype, run_key(name)) if run_key is not None else None
        if runs and key is not None and key == previous:
            runs[-1].append(name)
        else:
            runs.append([name])
        previous = key
    return runs


def _spans(header: Header, run_key: Callable[[str], Hashable] | None) -> list[tuple[int, int, str, torch.dtype]]:
    """(begin, end, first name, dtype) of each run of tensors (see tensor_runs), in payload order."""
    return [
        (header.offsets[run[0]][0], header.offsets[run[-1]][1], run[0], header.specs[run[0]].dtype)
        for run in tensor_runs(payload_order(header), header.specs, run_key)
    ]
