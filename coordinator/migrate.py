"""Apply the Alembic migrations in migrations/ to a coordinator database, safely from several processes at once."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, text

__all__ = ["MIGRATIONS_DIR", "alembic_config", "upgrade_database"]


def _migrations_dir() -> Path:
    """The top-level migrations/ of a source tree, or the copy an installed package carries inside it."""
    package = Path(__file__).resolve().parent
    installed = package / "migrations"
    return installed if (installed / "env.py").is_file() else package.parent / "migrations"


MIGRATIONS_DIR = _migrations_dir()
_MIGRATION_LOCK_KEY = 0x63617264696F  # PostgreSQL advisory lock id ("cardio")


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's config for our migrations, optionally bound to an open connection."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def upgrade_database(engine: Engine) -> None:
    """Bring the database to the newest revision; concurrent callers wait for each other.

    On PostgreSQL a transaction-scoped advisory lock serialises workers that start together;
    SQLite's BEGIN IMMEDIATE (coordinator.db) does the same there.
    """
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
        command.upgrade(alembic_config(connection), "head")
