"""The database as the coordinator's own commands open it: migrated, one session, the engine disposed after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session

from coordinator.config import CoordinatorSettings
from coordinator.db import make_engine, make_sessionmaker
from coordinator.migrate import upgrade_database
from coordinator.models import Role
from coordinator.signals.work import track_work
from coordinator.sites.security import Principal

__all__ = ["CLI_ADMIN", "admin_session"]

CLI_ADMIN = Principal(Role.ADMIN, actor="cli")  # who audit events name for commands run on the coordinator's host


@contextmanager
def admin_session(settings: CoordinatorSettings | None = None) -> Iterator[Session]:
    """A session on CARDIOFL_DATABASE_URL (or `settings`), after migrating it."""
    engine = make_engine((settings or CoordinatorSettings()).database_url)
    try:
        upgrade_database(engine)
        sessions = make_sessionmaker(engine)
        track_work(sessions)  # a study started here wakes the server's waiting polls
        with sessions() as session:
            yield session
    finally:
        engine.dispose()
