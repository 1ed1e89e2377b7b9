"""`cardiofl coordinator tls`: the private CA, site kits, signing, renewal and revocation, and `serve`'s TLS options."""

from __future__ import annotations

import ipaddress
import ssl
import tomllib
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from coordinator.main import create_app
from coordinator.pki.tls import TlsFolder, issued
from coordinator.serving.tls import uvicorn_tls_options
from shared.tls import key_matches, load_private_key, new_private_key, private_key_pem, write_private
from site_agent.client import CoordinatorClient
from site_agent.errors import Unauthorized
from site_agent.tls import certificate_request
from tests.conftest import coordinator_settings_for

runner = CliRunner()


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    """The admin's environment on the coordinator's host: its database and TLS folder."""
    return {
        "CARDIOFL_DATABASE_URL": f"sqlite:///{tmp_path / 'coordinator.db'}",
        "CARDIOFL_TLS_DIR": str(tmp_path / "tls"),
    }


def cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env=env)
    return result.exit_code, result.output


@pytest.fixture()
def folder(env: dict[str, str]) -> TlsFolder:
    code, out = cli(env, "coordinator", "tls", "init", "--host", "coordinator.example.org", "--host", "127.0.0.1")
    assert code == 0, out
    return TlsFolder(Path(env["CARDIOFL_TLS_DIR"]))


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def site_of(api: TestClient, token: str) -> str | None:
    """The site a token opens, asked as its agent asks (None: refused)."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(transport=api._transport, base_url=str(api.base_url), headers=headers) as http:
        try:
            return CoordinatorClient(http).own_site()
        except Unauthorized:
            return None


def test_init_makes_a_ca_and_a_server_certificate_for_every_host(folder: TlsFolder, env: dict[str, str]) -> None:
    assert mode(folder.path) == 0o700 and mode(folder.ca_key) == 0o600 and mode(folder.server_key) == 0o600
    ca, server = cert(folder.ca_cert), cert(folder.server_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["coordinator.example.org"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    key = load_private_key(folder.server_key)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1" and key_matches(server, key)
    assert list(x509.load_pem_x509_crl(folder.crl.read_bytes())) == []
    code, out = cli(env, "coordinator", "tls", "init", "--host", "127.0.0.1")  # never over an existing CA
    assert code == 1 and "already holds a CA" in out
    assert cert(folder.ca_cert) == ca


@pytest.mark.parametrize("host", ["bad host", "-x", "a/b"])
def test_init_refuses_what_is_no_host(env: dict[str, str], host: str) -> None:
    code, out = cli(env, "coordinator", "tls", "init", "--host", host)
    assert code == 1 and "neither a host name nor an IP address" in out


def test_site_kit_enrols_the_site_and_writes_its_files(folder: TlsFolder, env: dict[str, str], tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    url = "https://coordinator.example.org:8443"
    code, out = cli(
        env, "coordinator", "tls", "site-kit", "lyon", "--out", str(kit), "--url", url, "--client-cert", "issue"
    )
    assert code == 0, out
    assert sorted(p.name for p in kit.iterdir()) == ["ca.pem", "client.key", "client.pem", "site.toml", "token"]
    assert mode(kit) == 0o700 and mode(kit / "token") == 0o600 and mode(kit / "client.key") == 0o600
    assert (kit / "ca.pem").read_bytes() == folder.ca_cert.read_bytes()
    client = cert(kit / "client.pem")
    client.verify_directly_issued_by(cert(folder.ca_cert))
    assert ExtendedKeyUsageOID.CLIENT_AUTH in client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert key_matches(client, load_private_key(kit / "client.key"))
    config = tomllib.loads((kit / "site.toml").read_text())
    assert config["name"] == "lyon" and config["coordinator_url"] == url
    assert {config[k] for k in ("token_file", "ca_bundle", "client_cert", "client_key")} == {
        str(kit / name) for name in ("token", "ca.pem", "client.pem", "client.key")
    }
    assert "data" not in config and "# [[data]]" in (kit / "site.toml").read_text()  # the site names its own

    token = (kit / "token").read_text().strip()
    settings = coordinator_settings_for(env["CARDIOFL_DATABASE_URL"])
    with TestClient(create_app(settings)) as api:
        assert site_of(api, token) == "lyon"

        again = tmp_path / "again"  # enrolled already: only a deliberate rotation issues a new token
        code, out = cli(env, "coordinator", "tls", "site-kit", "lyon", "--out", str(again), "--url", url)
        assert code == 1 and "--rotate-token" in out and not again.exists()
        code, out = cli(
            env, "coordinator", "tls", "site-kit", "lyon", "--out", str(again), "--url", url, "--rotate-token"
        )
        assert code == 0 and "older ones revoked" in out
        assert site_of(api, token) is None
        assert site_of(api, (again / "token").read_text().strip()) == "lyon"
    assert "client_cert" not in tomllib.loads((again / "site.toml").read_text())  # no mutual TLS asked for


def test_site_kit_refuses_a_used_folder_or_a_plain_url(folder: TlsFolder, env: dict[str, str], tmp_path: Path) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "site.toml").write_text("mine")
    code, out = cli(env, "coordinator", "tls", "site-kit", "oslo", "--out", str(used), "--url", "https://c.example")
    assert code == 1 and "not an empty folder" in out and (used / "site.toml").read_text() == "mine"
    code, out = cli(env, "coordinator", "tls", "site-kit", "oslo", "--out", str(tmp_path / "k"), "--url", "http://c")
    assert code == 2 and "https://" in out
    code, out = cli(env, "coordinator", "tls", "site-kit", "Oslo!", "--out", str(tmp_path / "k"), "--url", "https://c")
    assert code == 2 and "lowercase" in out


def test_a_site_request_is_signed_for_its_own_name_only(folder: TlsFolder, env: dict[str, str], tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    args = ["coordinator", "tls", "site-kit", "oslo", "--out", str(kit), "--url", "https://c.example", "--client-cert"]
    code, out = cli(env, *args, "csr")
    assert code == 0 and "tls sign oslo.csr --site oslo" in out
    assert not (kit / "client.pem").exists() and not (kit / "client.key").exists()
    site_toml = kit / "site.toml"
    site_toml.write_text(site_toml.read_text() + f'[[data]]\nkind = "challenge"\npath = "{tmp_path}"\n')

    request = tmp_path / "oslo.csr"
    code, out = cli({}, "site", "tls", "request", "--config", str(site_toml), "--out", str(request))
    assert code == 0 and "made a new key" in out, out
    assert mode(kit / "client.key") == 0o600
    code, out = cli({}, "site", "tls", "request", "--config", str(site_toml), "--out", str(request))
    assert code == 2 and "refusing to overwrite" in out

    signed = tmp_path / "oslo.pem"
    code, out = cli(env, "coordinator", "tls", "sign", str(request), "--site", "lyon", "--out", str(signed))
    assert code == 1 and "not site 'lyon'" in out and not signed.exists()
    ghost = tmp_path / "ghost.csr"
    certificate_request("ghost", tmp_path / "ghost.key", ghost)
    code, out = cli(env, "coordinator", "tls", "sign", str(ghost), "--site", "ghost", "--out", str(signed))
    assert code == 1 and "not enrolled" in out
    code, out = cli(env, "coordinator", "tls", "sign", str(request), "--site", "oslo", "--out", str(signed))
    assert code == 0, out
    assert key_matches(cert(signed), load_private_key(kit / "client.key"))  # the site's key, which never moved

    # a second request from the same key renews the certificate the same way
    code, out = cli({}, "site", "tls", "request", "--config", str(site_toml), "--out", str(tmp_path / "again.csr"))
    assert code == 0 and "used the existing key" in out


def test_renewal_keeps_keys_and_revocation_fills_the_crl(
    folder: TlsFolder, env: dict[str, str], tmp_path: Path
) -> None:
    kit = tmp_path / "kit"
    args = ["site-kit", "graz", "--out", str(kit), "--url", "https://c.example", "--client-cert", "issue"]
    assert cli(env, "coordinator", "tls", *args)[0] == 0
    first = cert(kit / "client.pem")

    renewed = tmp_path / "renewed.pem"
    code, out = cli(env, "coordinator", "tls", "renew", "--site", "graz", "--out", str(renewed))
    assert code == 0, out
    assert cert(renewed).serial_number != first.serial_number
    assert key_matches(cert(renewed), load_private_key(kit / "client.key"))

    server, server_key = cert(folder.server_cert), folder.server_key.read_bytes()
    assert cli(env, "coordinator", "tls", "renew", "--server")[0] == 0
    kept = cert(folder.server_cert)
    assert kept.serial_number != server.serial_number and folder.server_key.read_bytes() == server_key
    assert kept.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ) == server.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert cli(env, "coordinator", "tls", "renew", "--server", "--new-key", "--host", "c.example")[0] == 0
    assert folder.server_key.read_bytes() != server_key and key_matches(
        cert(folder.server_cert), load_private_key(folder.server_key)
    )

    code, out = cli(env, "coordinator", "tls", "revoke", "--serial", f"{first.serial_number:X}")
    assert code == 0 and f"serial {first.serial_number:X}" in out
    code, out = cli(env, "coordinator", "tls", "revoke", "--site", "graz")  # the rest of graz's certificates
    assert code == 0 and out.count("revoked CN=graz") == 1
    revoked = {entry.serial_number for entry in x509.load_pem_x509_crl(folder.crl.read_bytes())}
    assert revoked == {first.serial_number, cert(renewed).serial_number}
    assert cli(env, "coordinator", "tls", "revoke", "--site", "graz")[0] == 1  # nothing left to revoke
    code, out = cli(env, "coordinator", "tls", "renew", "--site", "graz", "--out", str(tmp_path / "x.pem"))
    assert code == 1 and "no unrevoked certificate" in out  # a revoked key is not renewed
    code, out = cli(env, "coordinator", "tls", "revoke", "--serial", f"{kept.serial_number:X}")
    assert code == 1 and "site certificates" in out  # the server's is not revoked this way

    code, out = cli(env, "coordinator", "tls", "list")
    assert code == 0 and out.count(" revoked ") == 2 and out.count(" server ") == 3
    assert {item.certificate.serial_number for item in issued(folder) if item.revoked_at} == revoked


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mutual-tls"], "--tls-dir"),
        (["--tls-dir", "nowhere"], "is missing"),
        (["--ssl-keyfile", "key.pem"], "--ssl-certfile"),
    ],
)
def test_serve_refuses_tls_options_it_cannot_honour(env: dict[str, str], args: list[str], message: str) -> None:
    code, out = cli({"CARDIOFL_DATABASE_URL": env["CARDIOFL_DATABASE_URL"]}, "coordinator", "serve", *args)
    assert code == 2 and message in out


def test_a_request_with_a_weak_key_is_refused(folder: TlsFolder, env: dict[str, str], tmp_path: Path) -> None:
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lyon")])
    request = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(weak, hashes.SHA256())
    path = tmp_path / "weak.csr"
    path.write_bytes(request.public_bytes(serialization.Encoding.PEM))
    code, out = cli(env, "coordinator", "tls", "sign", str(path), "--site", "lyon", "--out", str(tmp_path / "w.pem"))
    assert code == 1 and "RSA of 2048+ bits" in out


async def _no_app(scope: dict, receive: object, send: object) -> None:
    """An ASGI app that is never called: only the TLS context is tested."""


def test_the_server_context_swaps_in_new_files_and_keeps_the_old_when_they_do_not_load(
    folder: TlsFolder, caplog: pytest.LogCaptureFixture
) -> None:
    options = uvicorn_tls_options(folder.server_cert, folder.server_key, ca_file=folder.ca_cert, crl_file=folder.crl)
    options["ssl_context_factory"].check_interval_s = 0.0
    config = uvicorn.Config(_no_app, log_config=None, ws="none", **options)  # the test keeps its own logging
    config.load()
    listening = config.ssl
    assert listening is not None and listening.verify_mode == ssl.CERT_REQUIRED
    assert listening.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF

    def hello() -> ssl.SSLContext:
        """The context a new connection's handshake ends up with."""
        connection = SimpleNamespace(context=listening)
        listening.sni_callback(connection, None, listening)  # type: ignore[misc]
        return connection.context

    assert hello() is listening  # nothing changed
    good_key = folder.server_key.read_bytes()
    write_private(folder.server_key, private_key_pem(new_private_key()), replace=True)  # half of a key change
    assert hello() is listening and "do not load" in caplog.text
    write_private(folder.server_key, good_key, replace=True)
    renewed = hello()
    assert renewed is not listening and hello() is renewed
    assert renewed.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF
