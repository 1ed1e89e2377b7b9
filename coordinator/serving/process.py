"""How the coordinator's server process runs: one torch thread, a heap that does not grow with K, its log lines."""

from __future__ import annotations

import copy
import gc
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from shared.heap import trim_heap, tune_heap
from shared.logs import LogFormat, LogLevel, logging_config

__all__ = [
    "RECEIVE_BUFFER_BYTES",
    "bound_heap_growth",
    "configure_server_process",
    "freeze_startup_objects",
    "on_stop_signal",
    "release_free_heap",
    "server_log_config",
    "widen_receive_buffer",
]

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 16 << 20
TRIM_THRESHOLD_BYTES = 64 << 20
RECEIVE_BUFFER_BYTES = 4 << 20  # request body a connection reads ahead of the app before it stops reading


def configure_server_process() -> None:
    """Settings for a process that serves the coordinator (called once, before the app is built).

    Its tensor work (checking uploads, averaging) is memory-bound and runs beside request threads
    and other processes: one torch intra-op thread is faster than two contending ones.
    """
    import torch

    torch.set_num_threads(1)
    bound_heap_growth()
    widen_receive_buffer(RECEIVE_BUFFER_BYTES)


def server_log_config(log_format: LogFormat, level: LogLevel) -> dict[str, Any]:
    """The `log_config` uvicorn applies in each worker: the process's lines (shared.logs) and uvicorn's own.

    In text, uvicorn's lines keep its own look ("INFO:     Started server process"), as they always
    had; in JSON they go through the root logger's handler as one object a line, its access log
    included. Either way they follow `level`, and Alembic's and the coordinator's lines go to the root.
    """
    from uvicorn.config import LOGGING_CONFIG

    config = logging_config(log_format, level)
    if log_format == "json":
        propagating: dict[str, Any] = {"handlers": [], "level": level, "propagate": True}
        config["loggers"] = {name: dict(propagating) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}
        return config
    uvicorn = copy.deepcopy(LOGGING_CONFIG)
    for logger in uvicorn["loggers"].values():
        logger["level"] = level
    config["formatters"].update(uvicorn["formatters"])
    config["handlers"].update(uvicorn["handlers"])
    config["loggers"] = uvicorn["loggers"]
    return config


def widen_receive_buffer(limit: int) -> None:
    """Let uvicorn read up to `limit` bytes of a request body ahead of the app before it pauses the socket.

    uvicorn pauses reading once 64 KiB wait unread (its HIGH_WATER_LIMIT, not an option) and resumes
    when the app asks for more. An upload of a model is hashed and written a megabyte at a time, so at
    64 KiB the socket is paused and resumed thousands of times per upload, and the kernel's TCP work
    for a stalled receive window doubles what receiving costs: measured here, 1.35 s of CPU per GB
    received against 0.45 s with 4 MiB. Each connection holds at most `limit` more bytes in memory.
    """
    from uvicorn.protocols.http import h11_impl, httptools_impl

    for protocol in (h11_impl, httptools_impl):
        if not isinstance(getattr(protocol, "HIGH_WATER_LIMIT", None), int):
            raise RuntimeError(f"{protocol.__name__} no longer reads HIGH_WATER_LIMIT: the receive buffer is not set")
        protocol.HIGH_WATER_LIMIT = limit  # type: ignore[attr-defined]


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, the app) out of the cyclic garbage collector's sight.

    Called once the server has started: a full collection then scans only what requests created,
    instead of pausing the process (an aggregation included) for a tenth of a second or more.
    """
    gc.freeze()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signal(callback: Callable[[], None]) -> Callable[[], None]:
    """Call `callback` first when SIGINT or SIGTERM arrives, then the server's own handler; returns the undo.

    The server stops by waiting for requests in flight to finish, and a site's long-poll may wait
    half a minute for a task: the callback lets them answer at once instead. Only the main thread
    may set handlers, and only a handler that is a function (the server's) is chained; elsewhere
    (an app served by a test client) nothing is changed.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    chained = {sig: handler for sig, handler in previous.items() if callable(handler)}

    def handle(signum: int, frame: FrameType | None) -> None:
        callback()
        chained[signal.Signals(signum)](signum, frame)

    for sig in chained:
        signal.signal(sig, handle)

    def undo() -> None:
        for sig in chained:
            if signal.getsignal(sig) is handle:
                signal.signal(sig, previous[sig])

    return undo


def bound_heap_growth() -> bool:
    """Tell glibc's malloc to return large blocks to the system and to keep few per-thread arenas.

    Request threads allocate and free megabyte-sized buffers (chunks of uploads and downloads); by
    default each thread gets an arena of its own that keeps what it freed, so resident memory grows
    with the number of concurrent transfers. Two arenas serve every thread here, and a fixed 16 MiB
    mmap threshold (instead of one that rises with what was freed) returns every model-sized block
    to the system when freed. Below it, up to 64 MiB of freed heap is kept rather than returned at
    once: aggregation reads megabyte windows over and over, and a heap handed back and taken again
    costs a page fault every 4 KiB, slower than the reading itself (release_free_heap hands it back
    once a round is settled). Returns False where the C library is not glibc.
    """
    applied = tune_heap(mmap_threshold=MMAP_THRESHOLD_BYTES, trim_threshold=TRIM_THRESHOLD_BYTES, arenas=2)
    if not applied:
        log.info("mallopt refused the heap settings; memory may grow with concurrent transfers")
    global _heap_kept
    _heap_kept = applied
    return applied


_heap_kept = False  # whether bound_heap_growth told malloc to keep freed heap (a served process)


def release_free_heap() -> bool:
    """In a served process (bound_heap_growth), hand malloc's free pages back to the system; whether it did.

    Called once a round's aggregation is over: what it freed (up to TRIM_THRESHOLD_BYTES at the top
    of a heap, and free pages between live blocks, which no threshold returns) is then idle until the
    next round, and kept it made a coordinator's resident memory creep up over hundreds of rounds
    with nothing alive behind it (bench/soak.py). glibc's malloc_trim walks the free blocks. Elsewhere
    (tests, the simulation runner) malloc keeps its defaults and nothing is done.
    """
    return _heap_kept and trim_heap()
