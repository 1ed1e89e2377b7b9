"""Alembic environment of the coordinator's database.

`coordinator.migrate.upgrade_database` hands in an open connection (config.attributes["connection"]);
a plain `alembic upgrade head` connects to CARDIOFL_DATABASE_URL itself.

Logging is never configured here with `logging.config.fileConfig` (there is no alembic.ini): that
would replace the handlers of the process that migrates (`cardiofl coordinator serve|migrate`), and
Alembic's lines must come out in its CARDIOFL_LOG_FORMAT. A plain `alembic` command, which configured
nothing, logs as the coordinator would (shared.logs.setup_logging leaves configured logging alone).
"""

from __future__ import annotations

from typing import Any

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection
from sqlalchemy.pool import NullPool

from coordinator.config import CoordinatorSettings
from coordinator.db import UTCDateTime, make_engine
from coordinator.models import Base
from shared.logs import setup_logging

target_metadata = Base.metadata


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    """Write UTCDateTime as the plain column type it stores, so revisions never import app code."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def run_migrations(connection: Connection) -> None:
    """Migrate over `connection`; SQLite alters tables in batch mode (copy and move)."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """Emit the SQL for the configured URL instead of running it."""
    context.configure(
        url=CoordinatorSettings().database_url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


given = context.config.attributes.get("connection")
if given is None:
    settings = CoordinatorSettings()
    setup_logging(settings.log_format, settings.log_level)
if context.is_offline_mode():
    run_offline()
elif given is not None:
    run_migrations(given)
else:
    engine = make_engine(CoordinatorSettings().database_url, poolclass=NullPool)
    with engine.begin() as connection:
        run_migrations(connection)
    engine.dispose()
