"""`cardiofl coordinator tls ...`: the private CA, site kits, signing, renewal and revocation (on the CA's host)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509
from pydantic import TypeAdapter, ValidationError

from coordinator.errors import AlreadyExists, CoordinatorError, NotFound
from coordinator.pki.site_kit import ClientCert, Kit, write_kit
from coordinator.pki.tls import (
    CA_DAYS,
    CERT_DAYS,
    TlsError,
    TlsFolder,
    certificates_of,
    init_folder,
    issue_server,
    issue_site,
    issued,
    public_key_of_csr,
    revoke,
    server_hosts,
)
from shared.terms import SiteName
from shared.tls import (
    certificate_pem,
    describe,
    fingerprint,
    new_private_key,
    private_key_pem,
    utc_now,
    write_private,
    write_public,
)

__all__ = ["tls_app"]

tls_app = typer.Typer(
    help="The coordinator's private CA: HTTPS certificates, site kits, signing, renewal, revocation.",
    no_args_is_help=True,
)

DirOption = Annotated[
    Path | None, typer.Option("--dir", help="The TLS folder of `tls init` (default: CARDIOFL_TLS_DIR).")
]
DaysOption = Annotated[int, typer.Option(min=1, help="Days the certificate is valid (capped at the CA's end).")]
SiteOption = Annotated[str, typer.Option("--site", help="The site's name, as enrolled.")]
RESTART_NOTE = "agents keep running; nothing is restarted"


def _folder(path: Path | None) -> TlsFolder:
    from coordinator.config import CoordinatorSettings  # SQLAlchemy's URLs: the command's, not `cardiofl --help`'s

    chosen = path or CoordinatorSettings().tls_dir
    if not chosen:
        raise typer.BadParameter("name the TLS folder with --dir or CARDIOFL_TLS_DIR", param_hint="--dir")
    return TlsFolder(Path(chosen))


@contextmanager
def _refusals() -> Iterator[None]:
    """A refused request ends the command with one line and exit code 1."""
    try:
        yield
    except (TlsError, CoordinatorError, FileExistsError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(1) from None


def _check_site_name(name: str) -> None:
    try:
        TypeAdapter(SiteName).validate_python(name)
    except ValidationError:
        raise typer.BadParameter(f"{name!r}: lowercase letters, digits, '.', '_' or '-'", param_hint="NAME") from None


@tls_app.command("init")
def init_command(
    host: Annotated[list[str], typer.Option("--host", help="A DNS name or IP address sites use; repeat.")],
    folder_dir: DirOption = None,
    days: DaysOption = CERT_DAYS,
    ca_days: Annotated[int, typer.Option(min=1, help="Days the CA is valid.")] = CA_DAYS,
) -> None:
    """Create the private CA (ECDSA P-256), the server certificate for every --host, and an empty CRL."""
    folder = _folder(folder_dir)
    with _refusals():
        init_folder(folder.path, host, days=days, ca_days=ca_days)
    ca = x509.load_pem_x509_certificate(folder.ca_cert.read_bytes())
    typer.echo(f"created a CA and the coordinator's certificate in {folder.path} (mode 700):")
    typer.echo(f"  ca.pem                 the CA certificate, every site's ca_bundle ({describe(ca)})")
    typer.echo("  ca.key                 the CA's key (mode 600): keep it on this host, back it up offline")
    typer.echo(f"  server.pem, server.key the coordinator's certificate for {', '.join(host)}; key mode 600")
    typer.echo("  crl.pem                revoked certificates (none yet); issued/ keeps a copy of each certificate")
    typer.echo(f"CA fingerprint (SHA-256): {fingerprint(ca)}")
    typer.echo(f"serve HTTPS with: cardiofl coordinator serve --tls-dir {folder.path} [--mutual-tls]")


@tls_app.command("site-kit")
def site_kit_command(
    name: Annotated[str, typer.Argument(help="The site's name: lowercase letters, digits, '.', '_' or '-'.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="A new folder for the kit (mode 700).")],
    url: Annotated[
        str | None, typer.Option(help="How the site reaches the coordinator (default: CARDIOFL_PUBLIC_URL).")
    ] = None,
    client_cert: Annotated[
        ClientCert | None,
        typer.Option(
            help="Mutual TLS: none; issue (key and certificate made here, in the kit); csr (the site makes its "
            "key, you sign its request). Default: csr with CARDIOFL_TLS_MUTUAL, else none."
        ),
    ] = None,
    install_dir: Annotated[
        Path | None, typer.Option(help="Where the kit will live at the site (default: --out, absolute).")
    ] = None,
    rotate_token: Annotated[
        bool, typer.Option(help="The site is enrolled already: give it a new token (its current one stops working).")
    ] = False,
    folder_dir: DirOption = None,
    days: DaysOption = CERT_DAYS,
) -> None:
    """Enrol a site (or rotate its token) and write its kit: site.toml, token, ca.pem, maybe a client certificate."""
    from coordinator.config import CoordinatorSettings

    _check_site_name(name)
    settings = CoordinatorSettings()
    public_url = url or settings.public_url
    if not public_url or not public_url.startswith("https://"):
        raise typer.BadParameter("give the coordinator's https:// URL (or set CARDIOFL_PUBLIC_URL)", param_hint="--url")
    mode = client_cert or (ClientCert.CSR if settings.tls_mutual else ClientCert.NONE)
    kit = Kit(name, public_url, out, (install_dir or out).absolute(), mode)
    folder = _folder(folder_dir)
    from coordinator.cli.admin_db import CLI_ADMIN, admin_session
    from coordinator.sites.access import enrol_site, rotate_site_token

    with _refusals():
        folder.require()
        kit.check_out()
        with admin_session(settings) as session:
            try:
                secret = enrol_site(session, name=name, by=CLI_ADMIN)[2]
                how = f"enrolled site {name}"
            except AlreadyExists:
                if not rotate_token:
                    raise TlsError(
                        f"site {name!r} is already enrolled: --rotate-token gives it a new token in the kit "
                        "(the token its agent holds now stops working)"
                    ) from None
                secret = rotate_site_token(session, name=name, by=CLI_ADMIN)[1]
                how = f"new token for site {name}, older ones revoked"
        files = write_kit(kit, folder, secret, days=days)
    typer.echo(f"{how}; its kit is in {out}: {', '.join(path.name for path in files)}")
    if mode is ClientCert.ISSUE:
        typer.echo("  client.key was made here: hand the kit over as you would a password, then delete this copy")
    if mode is ClientCert.CSR:
        typer.echo(f"  the site sends you {name}.csr from `cardiofl site tls request`; sign it with:")
        typer.echo(f"  cardiofl coordinator tls sign {name}.csr --site {name} --out {name}.pem")
    typer.echo("  token holds a secret (mode 600); site.toml lists the site's remaining steps")


@tls_app.command("sign")
def sign_command(
    request: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="The site's .csr file.")],
    site: SiteOption,
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the certificate (PEM).")],
    folder_dir: DirOption = None,
    days: DaysOption = CERT_DAYS,
) -> None:
    """Sign a site's certificate request (`cardiofl site tls request`) after checking its name, key and enrolment."""
    from coordinator.cli.admin_db import admin_session
    from coordinator.sites.access import get_site

    folder = _folder(folder_dir)
    with _refusals():
        folder.require()
        public_key = public_key_of_csr(request.read_bytes(), site)
        with admin_session() as session:
            try:
                get_site(session, site)
            except NotFound:
                raise TlsError(f"site {site!r} is not enrolled: enrol it first (`tls site-kit` does)") from None
        certificate = issue_site(folder, site, public_key, days=days)
        write_public(out, certificate_pem(certificate))
    typer.echo(f"signed {describe(certificate)} into {out}")
    typer.echo("send it to the site: it goes where the site's client_cert setting points; then its agent restarts")


@tls_app.command("client")
def client_command(
    name: Annotated[str, typer.Argument(help="Who it is for, e.g. a researcher's user name (its CN).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="A new folder for the key, certificate and CA (mode 700).")],
    folder_dir: DirOption = None,
    days: DaysOption = CERT_DAYS,
) -> None:
    """Issue a person's client certificate (new key) for the `cardiofl` commands under mutual TLS."""
    folder = _folder(folder_dir)
    with _refusals():
        folder.require()
        if not name or len(name) > 64 or any(c.isspace() or c in "/\\" for c in name):
            raise TlsError(f"{name!r}: a client's name is 1-64 characters without spaces or slashes")
        if out.exists():
            raise TlsError(f"{out} exists; name a new folder")
        out.mkdir(parents=True, mode=0o700)
        key = new_private_key()
        certificate = issue_site(folder, name, key.public_key(), days=days)
        write_private(out / "client.key", private_key_pem(key))
        write_public(out / "client.pem", certificate_pem(certificate))
        write_public(out / "ca.pem", folder.ca_cert.read_bytes())
    typer.echo(f"issued {describe(certificate)} into {out} (client.key mode 600); hand it over privately, then:")
    typer.echo(f"  export CARDIOFL_CA_BUNDLE={out / 'ca.pem'} CARDIOFL_CLIENT_CERT={out / 'client.pem'} \\")
    typer.echo(f"         CARDIOFL_CLIENT_KEY={out / 'client.key'}")
    typer.echo("revoke it like a site's: cardiofl coordinator tls revoke --serial ...")


@tls_app.command("renew")
def renew_command(
    server: Annotated[bool, typer.Option("--server", help="Renew the coordinator's certificate.")] = False,
    site: Annotated[str | None, typer.Option("--site", help="Renew this site's certificate (same key).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="With --site: where to write it.")] = None,
    host: Annotated[
        list[str] | None, typer.Option("--host", help="With --server: the hosts (default: the current ones).")
    ] = None,
    new_key: Annotated[bool, typer.Option(help="With --server: a new key too.")] = False,
    folder_dir: DirOption = None,
    days: DaysOption = CERT_DAYS,
) -> None:
    """Renew the coordinator's certificate (served from the next handshake), or a site's for the key it has."""
    if server == (site is not None):
        raise typer.BadParameter("renew either --server or --site NAME")
    if site is not None and out is None:
        raise typer.BadParameter("--site needs --out, where the renewed certificate goes", param_hint="--out")
    folder = _folder(folder_dir)
    with _refusals():
        folder.require()
        if server:
            certificate = issue_server(folder, host or server_hosts(folder), days=days, new_key=new_key)
            typer.echo(f"renewed the coordinator's certificate: {describe(certificate)}")
            typer.echo(f"a running coordinator serves it from its next TLS handshake; {RESTART_NOTE}")
            return
        assert site is not None and out is not None
        live = [item for item in certificates_of(folder, site) if item.revoked_at is None]
        if not live:
            raise TlsError(f"site {site!r} has no unrevoked certificate to renew: sign a new request or make a kit")
        certificate = issue_site(folder, site, live[-1].certificate.public_key(), days=days)
        write_public(out, certificate_pem(certificate))
    typer.echo(f"renewed {describe(certificate)} into {out}, for the key the site already has")
    typer.echo("send it to the site: it replaces the file client_cert names, then the agent restarts;")
    typer.echo(f"the previous one stays valid until it expires ({describe(live[-1].certificate)}) unless revoked")


@tls_app.command("revoke")
def revoke_command(
    site: Annotated[str | None, typer.Option("--site", help="Revoke every certificate of this site.")] = None,
    serial: Annotated[list[str] | None, typer.Option("--serial", help="Revoke this certificate (hex); repeat.")] = None,
    folder_dir: DirOption = None,
) -> None:
    """Revoke site certificates in the CRL; a running coordinator refuses them from its next handshake."""
    if (site is None) == (not serial):
        raise typer.BadParameter("revoke either --site NAME or --serial HEX")
    folder = _folder(folder_dir)
    with _refusals():
        sites = [item for item in issued(folder.require()) if item.site]
        if site is not None:
            chosen = [item for item in sites if item.name == site and item.revoked_at is None]
            if not chosen:
                raise TlsError(f"site {site!r} has no unrevoked certificate")
        else:
            by_serial = {item.certificate.serial_number: item for item in sites}
            try:
                chosen = [by_serial[int(number, 16)] for number in serial or []]
            except (KeyError, ValueError):
                raise TlsError("--serial must name site certificates this CA issued (see `tls list`)") from None
        revoke(folder, [item.certificate.serial_number for item in chosen])
    for item in chosen:
        typer.echo(f"revoked {describe(item.certificate)}")
    typer.echo(f"the coordinator refuses them from its next TLS handshake; {RESTART_NOTE}")
    typer.echo("the site's token is unchanged: `cardiofl site revoke NAME` revokes it too")


@tls_app.command("list")
def list_command(folder_dir: DirOption = None) -> None:
    """List every certificate the CA issued: serial, kind, name, end of validity, state."""
    folder = _folder(folder_dir)
    with _refusals():
        items = issued(folder.require())
    now = utc_now()
    typer.echo(f"{'serial':<41} {'kind':<6} {'name':<24} {'valid until':<17} state")
    for item in items:
        end = item.certificate.not_valid_after_utc
        state = _state(item.revoked_at, end, now)
        kind = "site" if item.site else "server"
        typer.echo(f"{item.certificate.serial_number:<41X} {kind:<6} {item.name:<24} {end:%Y-%m-%d %H:%M} {state}")


def _state(revoked_at: dt.datetime | None, end: dt.datetime, now: dt.datetime) -> str:
    if revoked_at is not None:
        return f"revoked {revoked_at:%Y-%m-%d}"
    return "expired" if end < now else "valid"
