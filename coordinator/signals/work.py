"""Commits that may have given a site work, and the number in the database that every process reads to learn of them.

A commit that added or changed a round, a study, a site's approval, a site's job report or a token (a
round opened or moved to a secure phase, a study started or resumed, a site approved a study, a site
reported a job, which ends it and may end its study, a token was revoked, which ends its polls) also
raises `work_versions`' one number, and once committed calls this process's listener (which wakes its
waiting long-polls at once). Every coordinator process reads the number once per poll interval
(`work_version`) and wakes its own waiting polls when it moved: K waiting polls cost one query per
interval and process, not one each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, event, select, update
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker

from coordinator.db import reading
from coordinator.models import Round, SiteApproval, SiteReport, Study, Token, WorkVersion

__all__ = ["track_work", "work_version"]

_MAY_HAVE_WORK = "cardiofl.tasks_may_have_changed"
_GIVES_WORK = (Round, Study, SiteApproval, SiteReport, Token)  # what a waiting poll's answer depends on


def track_work(sessions: sessionmaker[Session], on_work: Callable[[], None] | None = None) -> None:
    """Each commit that wrote a round, study, approval, job report or token raises the number; then `on_work`."""

    def after_commit(session: Session) -> None:
        if session.info.pop(_MAY_HAVE_WORK, False) and on_work is not None:
            on_work()

    event.listen(sessions, "after_flush", _mark_flush)
    event.listen(sessions, "do_orm_execute", _mark_statement)
    event.listen(sessions, "before_commit", _raise_version)
    event.listen(sessions, "after_commit", after_commit)
    event.listen(sessions, "after_rollback", _forget)


def work_version(engine: Engine) -> int:
    """The number as the database has it now (0 before any commit gave work); takes no write lock."""
    with reading(engine).connect() as connection:
        return connection.scalar(select(WorkVersion.version).where(WorkVersion.id == 1)) or 0


def _raise_version(session: Session) -> None:
    """In the committing transaction, as its last write: add one to the number if the transaction may give work.

    Last, so on PostgreSQL the row's lock is held only for the commit and is never taken before another.
    """
    session.flush()  # the final flush, run now so that what it writes is marked
    if session.info.get(_MAY_HAVE_WORK):
        session.execute(update(WorkVersion).where(WorkVersion.id == 1).values(version=WorkVersion.version + 1))


def _mark_flush(session: Session, _context: Any) -> None:
    if any(isinstance(item, _GIVES_WORK) for item in (*session.new, *session.dirty)):
        session.info[_MAY_HAVE_WORK] = True


def _mark_statement(state: ORMExecuteState) -> None:
    if (state.is_update or state.is_insert) and state.bind_mapper is not None:
        if state.bind_mapper.class_ in _GIVES_WORK:
            state.session.info[_MAY_HAVE_WORK] = True


def _forget(session: Session) -> None:
    session.info.pop(_MAY_HAVE_WORK, None)
