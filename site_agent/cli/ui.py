"""`cardiofl site ui`: the approval page of the site's data owner, on 127.0.0.1 (site_agent/ui/server.py)."""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from site_agent.cli.approvals import describe_lines
from site_agent.cli.model import reported_errors, site_http

if TYPE_CHECKING:
    from site_agent.ui.server import SiteUi

__all__ = ["site_ui", "ui_command"]

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Site config file (TOML); CARDIOFL_SITE_* override it.")
]


def site_ui(config: Path | None, token: str) -> SiteUi:
    """The page's view of the site: its store's approvals (never automatic), its coordinator, its heartbeat."""
    from site_agent.approvals import Approvals
    from site_agent.client import CoordinatorClient
    from site_agent.config import check_settings, load_settings, open_store
    from site_agent.ui.server import SiteUi

    settings = load_settings(config)
    store = open_store(settings, check_settings(settings))
    return SiteUi(
        approvals=Approvals(store),
        client=lambda: CoordinatorClient(site_http(settings), tls=settings.tls),
        token=token,
        operator=f"operator {getpass.getuser()}",
        describe=describe_lines,  # as `cardiofl site approve` records it
        heartbeat=settings.heartbeat_file,
    )


def ui_command(
    config: ConfigOption = None,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: a free one).", min=0, max=65535)] = 8765,
    host: Annotated[
        str, typer.Option(help="Address to listen on; keep 127.0.0.1 (reach it from elsewhere by an SSH tunnel).")
    ] = "127.0.0.1",
) -> None:
    """Serve the approval page on 127.0.0.1: review, approve and revoke studies in a browser."""
    import socket

    import uvicorn

    from site_agent.ui.server import create_app, new_token

    with reported_errors():
        ui = site_ui(config, new_token())
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: listening on {host}, not 127.0.0.1: anyone who can reach it may try the token", err=True)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.bind((host, port))
    bound = listener.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    typer.echo(f"the approval page of site {ui.approvals.store.site} (this URL holds its token; Ctrl-C stops it):")
    typer.echo(f"  http://{shown}:{bound}/#token={ui.token}")
    hosts = ("127.0.0.1", "localhost", "[::1]", "::1", host)
    app = create_app(ui, allowed_hosts=hosts)
    # log_config None keeps logging as it is; the page speaks no WebSocket, so none of its libraries loads.
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", ws="none"))
    server.run(sockets=[listener])
