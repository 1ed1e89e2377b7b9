"""`cardiofl site tls request`: this site's TLS key, made here and kept here, and a request for the coordinator's CA."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["tls_app"]

tls_app = typer.Typer(help="This site's client certificate for mutual TLS.", no_args_is_help=True)


@tls_app.command("request")
def request_command(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Site config file (TOML); CARDIOFL_SITE_* override it.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the request (PEM), e.g. NAME.csr.")],
) -> None:
    """Make the key at `client_key` (mode 600) unless it exists, and a certificate request for site `name`."""
    from site_agent.config import load_settings
    from site_agent.errors import ConfigError
    from site_agent.tls import certificate_request

    try:
        settings = load_settings(config)
        if settings.client_key is None:
            raise ConfigError("setting 'client_key' is not set: it names where this site's TLS key is kept")
        made = certificate_request(settings.name, settings.client_key, out)
    except (ConfigError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    key = "made a new key" if made else "used the existing key"
    typer.echo(f"{key} in {settings.client_key} (mode 600; it never leaves this site)")
    typer.echo(f"wrote the request for site {settings.name} to {out}: send it to the coordinator's admin, who runs")
    typer.echo(f"  cardiofl coordinator tls sign {out.name} --site {settings.name} --out {settings.name}.pem")
    typer.echo(f"and put the certificate they return at {settings.client_cert or 'the path client_cert names'}")
