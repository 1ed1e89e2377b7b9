"""Wakes this process's waiting long-polls as soon as a commit may have given a site work.

A commit that added or changed a round, a study or a site's approval (a round opened, a study
started or resumed, a site approved a study) bumps a version and wakes every waiting
`GET /tasks/next` (and every waiting `GET /rounds/{id}/secagg`: a secure phase change is an UPDATE
of the round), which then looks again at once instead of at its next poll interval. Other
processes (several workers on PostgreSQL) are not told: their pollers still find the task within
CARDIOFL_TASK_POLL_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker

from coordinator.models import Round, SiteApproval, Study

__all__ = ["TaskSignal"]

_MAY_HAVE_WORK = "cardiofl.tasks_may_have_changed"


class TaskSignal:
    """A version counter that waiters can await; `notify` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self._closed = False
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def version(self) -> int:
        """Read this before looking for work; pass it to `wait` afterwards."""
        return self._version

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
        """Notify after each commit of a session from `sessions` that wrote a round or a study."""
        event.listen(sessions, "after_flush", _mark_flush)
        event.listen(sessions, "do_orm_execute", _mark_statement)
        event.listen(sessions, "after_commit", self._after_commit)
        event.listen(sessions, "after_rollback", _forget)

    def _after_commit(self, session: Session) -> None:
        if session.info.pop(_MAY_HAVE_WORK, False):
            self.notify()


def _mark_flush(session: Session, _context: Any) -> None:
    if any(isinstance(item, Round | Study | SiteApproval) for item in (*session.new, *session.dirty)):
        session.info[_MAY_HAVE_WORK] = True


def _mark_statement(state: ORMExecuteState) -> None:
    if (state.is_update or state.is_insert) and state.bind_mapper is not None:
        if state.bind_mapper.class_ in (Round, Study, SiteApproval):
            state.session.info[_MAY_HAVE_WORK] = True


def _forget(session: Session) -> None:
    session.info.pop(_MAY_HAVE_WORK, None)
