"""`cardiofl coordinator serve|migrate|create-token`: run the API, migrate its database, bootstrap tokens."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

GRACEFUL_STOP_S = 10  # a request still running this long after SIGTERM is cut (a site retries its upload)

coordinator_app = typer.Typer(help="Run the coordinator and manage its database.", no_args_is_help=True)


@coordinator_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes (PostgreSQL for more than one).")] = 1,
    ssl_certfile: Annotated[Path | None, typer.Option(help="TLS certificate (PEM); with --ssl-keyfile.")] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(help="TLS private key (PEM).")] = None,
) -> None:
    """Serve the REST API under uvicorn; the database is migrated once before the workers start."""
    import uvicorn

    from coordinator.config import CoordinatorSettings
    from coordinator.db import make_engine
    from coordinator.migrate import upgrade_database

    settings = CoordinatorSettings()
    if settings.migrate_on_start:
        engine = make_engine(settings.database_url)
        upgrade_database(engine)
        engine.dispose()
        os.environ["CARDIOFL_MIGRATE_ON_START"] = "false"  # done: the workers need not repeat it
    uvicorn.run(
        "coordinator.main:create_app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        timeout_graceful_shutdown=GRACEFUL_STOP_S,
        ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
        ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
    )


@coordinator_app.command("migrate")
def migrate() -> None:
    """Apply every pending Alembic migration to CARDIOFL_DATABASE_URL."""
    from coordinator.config import CoordinatorSettings
    from coordinator.db import make_engine
    from coordinator.migrate import upgrade_database

    engine = make_engine(CoordinatorSettings().database_url)
    upgrade_database(engine)
    engine.dispose()
    typer.echo("database is at the newest revision")


@coordinator_app.command("create-token")
def create_token(
    role: Annotated[str, typer.Option(help="admin, researcher or viewer.")] = "admin",
    label: Annotated[str, typer.Option(help="Who or what the token is for.")] = "created on the command line",
) -> None:
    """Issue a token directly in the database (bootstrap); prints the secret once."""
    from coordinator.access import create_token as issue
    from coordinator.config import CoordinatorSettings
    from coordinator.db import make_engine, make_sessionmaker
    from coordinator.errors import CoordinatorError
    from coordinator.migrate import upgrade_database
    from coordinator.models import Role
    from coordinator.security import Principal

    try:
        chosen = Role(role)
    except ValueError:
        raise typer.BadParameter(f"role must be admin, researcher or viewer, not {role!r}") from None
    engine = make_engine(CoordinatorSettings().database_url)
    upgrade_database(engine)
    try:
        with make_sessionmaker(engine)() as session:
            token, secret = issue(session, role=chosen, label=label, by=Principal(Role.ADMIN, actor="cli"))
    except CoordinatorError as exc:
        raise typer.BadParameter(exc.message) from None
    finally:
        engine.dispose()
    typer.echo(f"token {token.id} ({chosen.value}); shown once:")
    typer.echo(secret)
