"""Wakes this process's waiting long-polls as soon as a commit may have given a site work.

A commit of this process that added or changed a round, a study, a site's approval or a token wakes every
waiting `GET /tasks/next`, `GET /rounds/{id}/secagg` and `GET /studies/{id}/rounds?settled=`, which
then look again at once. Other processes' commits (several workers, replicas) reach them through
the database's work version (coordinator/signals/work.py), which the app reads once per
CARDIOFL_TASK_POLL_INTERVAL_S and passes to `observe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from sqlalchemy.orm import Session, sessionmaker

from coordinator.signals.work import track_work

__all__ = ["TaskSignal"]


class TaskSignal:
    """A version counter that waiters can await; `notify` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self._closed = False
        self._observed: int | None = None  # the database's work version when last observed
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def version(self) -> int:
        """Read this before looking for work; pass it to `wait` afterwards."""
        return self._version

    @property
    def waiting(self) -> bool:
        """True while a long-poll waits (only then is the database's work version worth reading)."""
        return bool(self._waiters)

    @property
    def closed(self) -> bool:
        """True once the server is stopping: waiters return at once and should answer without work."""
        return self._closed

    def close(self) -> None:
        """Wake every waiter for good (the server is stopping); later waits return at once. Safe from any thread."""
        self._closed = True
        self.notify()

    def notify(self) -> None:
        """Bump the version and wake every waiter."""
        with self._lock:
            self._version += 1
            waiters = list(self._waiters)
        for loop, woken in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed meanwhile
                loop.call_soon_threadsafe(woken.set)

    async def wait(self, seen: int, timeout: float) -> None:
        """Return once the version differs from `seen` (at once if it already does), or after `timeout` s."""
        woken = asyncio.Event()
        entry = (asyncio.get_running_loop(), woken)
        with self._lock:
            if self._version != seen or self._closed:
                return
            self._waiters.add(entry)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout)
        finally:
            with self._lock:
                self._waiters.discard(entry)

    def watch(self, sessions: sessionmaker[Session]) -> None:
        """Notify after each commit of a session from `sessions` that may have given a site work."""
        track_work(sessions, self.notify)

    def observe(self, version: int) -> None:
        """The database's work version, read just now: notify when it moved since the last one observed."""
        moved = self._observed is not None and version != self._observed
        self._observed = version
        if moved:
            self.notify()
