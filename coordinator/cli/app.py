"""`cardiofl coordinator serve|migrate|create-token|token|tls`: serve the API, migrate, bootstrap tokens and TLS."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from coordinator.cli.tls import tls_app
from coordinator.serving.limits import HEADER_TIMEOUT_ENV, HEADER_TIMEOUT_S, HTTP_PROTOCOL

if TYPE_CHECKING:
    from coordinator.config import CoordinatorSettings

GRACEFUL_STOP_S = 10  # a request still running this long after SIGTERM is cut (a site retries its upload)
# An idle keep-alive connection is closed after this long: well beyond an agent's own 5 s (httpx's
# default), so the agent always drops an idle connection first. With equal limits a site that
# starts an upload as the coordinator closes its connection loses the request ("Server
# disconnected without sending a response"), seen with 16 agents masking on two cores.
KEEP_ALIVE_S = 65

coordinator_app = typer.Typer(help="Run the coordinator and manage its database.", no_args_is_help=True)
coordinator_app.add_typer(tls_app, name="tls")
token_app = typer.Typer(help="The bootstrap admin token (CARDIOFL_ADMIN_TOKEN).", no_args_is_help=True)
coordinator_app.add_typer(token_app, name="token")
APP = "coordinator.main:create_app_from_env"
MUTUAL_TLS_APP = "coordinator.main:create_mutual_tls_app_from_env"


def settings_from_env() -> CoordinatorSettings:
    """The settings from CARDIOFL_* variables (and .env); a wrong one exits 2 with a line naming it, never its value."""
    from pydantic import ValidationError

    from coordinator.config import CoordinatorSettings

    try:
        return CoordinatorSettings()
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            name = "CARDIOFL_" + "_".join(str(part) for part in error["loc"]).upper()
            message = error["msg"].removeprefix("Value error, ")
            typer.echo(f"error: {message if message.startswith(name) else f'{name}: {message}'}", err=True)
        raise typer.Exit(2) from None


@coordinator_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes (PostgreSQL for more than one).")] = 1,
    ssl_certfile: Annotated[Path | None, typer.Option(help="TLS certificate (PEM); with --ssl-keyfile.")] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(help="TLS private key (PEM).")] = None,
    tls_dir: Annotated[
        Path | None,
        typer.Option(help="Serve HTTPS with the certificate `tls init` made there (default: CARDIOFL_TLS_DIR)."),
    ] = None,
    mutual_tls: Annotated[
        bool | None,
        typer.Option(
            "--mutual-tls/--no-mutual-tls",
            help="Require a client certificate from the folder's CA, checked against its CRL "
            "(default: CARDIOFL_TLS_MUTUAL).",
        ),
    ] = None,
    header_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds a client has to send a whole request header, from connecting or from a request's "
            "first byte; a client that is later (one byte a second, or nothing) is disconnected.",
        ),
    ] = HEADER_TIMEOUT_S,
) -> None:
    """Serve the REST API under uvicorn; the database is migrated once before the workers start.

    Renewed certificates and CRLs in the TLS folder are picked up at the next TLS handshake, without a restart.
    """
    import uvicorn

    from coordinator.db import make_engine
    from coordinator.migrate import upgrade_database
    from coordinator.serving.process import server_log_config

    settings = settings_from_env()
    os.environ[HEADER_TIMEOUT_ENV] = str(header_timeout)  # read by every worker's connections
    app, tls = _https(settings, ssl_certfile, ssl_keyfile, tls_dir, mutual_tls)
    log_config = server_log_config(settings.log_format, settings.log_level)
    _setup_logging(settings)  # Alembic's lines below already look like the workers' lines
    if settings.migrate_on_start:
        engine = make_engine(settings.database_url)
        upgrade_database(engine)
        engine.dispose()
        os.environ["CARDIOFL_MIGRATE_ON_START"] = "false"  # done: the workers need not repeat it
    uvicorn.run(
        app,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        timeout_graceful_shutdown=GRACEFUL_STOP_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=HTTP_PROTOCOL,
        ws="none",  # no route speaks WebSocket: none of its libraries is loaded
        log_config=log_config,
        **tls,
    )


def _setup_logging(settings: CoordinatorSettings) -> None:
    """Log the lines of this process in CARDIOFL_LOG_FORMAT at CARDIOFL_LOG_LEVEL (shared/logs.py)."""
    from shared.logs import setup_logging

    setup_logging(settings.log_format, settings.log_level)


def _https(
    settings: CoordinatorSettings,
    certfile: Path | None,
    keyfile: Path | None,
    tls_dir: Path | None,
    mutual: bool | None,
) -> tuple[str, dict[str, Any]]:
    """The app factory to serve and uvicorn's TLS keywords (none: plain HTTP) for the options given."""
    from coordinator.pki.tls import TlsError, TlsFolder
    from coordinator.serving.tls import uvicorn_tls_options

    folder_path = tls_dir or (Path(settings.tls_dir) if settings.tls_dir else None)
    mutual = settings.tls_mutual if mutual is None else mutual
    if keyfile and not certfile:
        raise typer.BadParameter("--ssl-keyfile goes with --ssl-certfile", param_hint="--ssl-keyfile")
    if folder_path and certfile:
        raise typer.BadParameter("serve either the TLS folder or --ssl-certfile, not both", param_hint="--tls-dir")
    if mutual and not folder_path:
        raise typer.BadParameter("mutual TLS needs the CA's folder (--tls-dir)", param_hint="--mutual-tls")
    if folder_path is None:
        return APP, uvicorn_tls_options(certfile, keyfile) if certfile else {}
    try:
        folder = TlsFolder(folder_path).require()
    except TlsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tls-dir") from None
    os.environ["CARDIOFL_TLS_DIR"] = str(folder.path)  # what the workers' "settings in force" line shows
    os.environ["CARDIOFL_TLS_MUTUAL"] = str(mutual).lower()
    if not mutual:
        return APP, uvicorn_tls_options(folder.server_cert, folder.server_key)
    options = uvicorn_tls_options(folder.server_cert, folder.server_key, ca_file=folder.ca_cert, crl_file=folder.crl)
    return MUTUAL_TLS_APP, options


@coordinator_app.command("migrate")
def migrate() -> None:
    """Apply every pending Alembic migration to CARDIOFL_DATABASE_URL."""
    from coordinator.db import make_engine
    from coordinator.migrate import upgrade_database

    settings = settings_from_env()
    _setup_logging(settings)
    engine = make_engine(settings.database_url)
    upgrade_database(engine)
    engine.dispose()
    typer.echo("database is at the newest revision")


@coordinator_app.command("create-token")
def create_token(
    role: Annotated[str, typer.Option(help="admin, researcher or viewer.")] = "admin",
    label: Annotated[str, typer.Option(help="Who or what the token is for.")] = "created on the command line",
) -> None:
    """Issue a token directly in the database (bootstrap); prints the secret once."""
    from coordinator.cli.admin_db import CLI_ADMIN, admin_session
    from coordinator.errors import CoordinatorError
    from coordinator.models import Role
    from coordinator.sites.access import create_token as issue

    try:
        chosen = Role(role)
    except ValueError:
        raise typer.BadParameter(f"role must be admin, researcher or viewer, not {role!r}") from None
    try:
        with admin_session(settings_from_env()) as session:
            token, secret = issue(session, role=chosen, label=label, by=CLI_ADMIN)
    except CoordinatorError as exc:
        raise typer.BadParameter(exc.message) from None
    typer.echo(f"token {token.id} ({chosen.value}); shown once:")
    typer.echo(secret)


@token_app.command("generate")
def generate_token() -> None:
    """Print a new random bootstrap admin token, fit for CARDIOFL_ADMIN_TOKEN (43 base64url characters)."""
    from coordinator.config import generate_admin_token

    typer.echo(generate_admin_token())
