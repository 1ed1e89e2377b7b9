"""A site kit: the folder an admin hands to a hospital (site.toml, its token, the CA bundle, a client certificate)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cryptography import x509

from coordinator.pki.tls import TlsError, TlsFolder, issue_site
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

__all__ = ["ClientCert", "Kit", "write_kit"]


class ClientCert(StrEnum):
    """Whether a kit carries a client certificate for mutual TLS, and where its key is made."""

    NONE = "none"  # no mutual TLS
    ISSUE = "issue"  # key and certificate made here, on the CA's host, and put in the kit
    CSR = "csr"  # the site makes its key and a request (`cardiofl site tls request`); the admin signs it


@dataclass(frozen=True)
class Kit:
    """What goes in a kit, and where its files will live at the site (`install_dir`)."""

    site: str
    url: str
    out: Path
    install_dir: Path
    client_cert: ClientCert

    def at_site(self, name: str) -> str:
        """A file's path at the site, as a TOML string."""
        return json.dumps(str(self.install_dir / name), ensure_ascii=False)

    def check_out(self) -> None:
        """Refuse an `out` folder that is not new or empty (a kit never overwrites files)."""
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise TlsError(f"{self.out} is not an empty folder; a kit is written into a new one")


def write_kit(kit: Kit, folder: TlsFolder, token: str, *, days: int) -> list[Path]:
    """Write the kit's files (secrets mode 600, the folder mode 700); the files written."""
    kit.check_out()
    kit.out.mkdir(parents=True, exist_ok=True)
    kit.out.chmod(0o700)
    ca = x509.load_pem_x509_certificate(folder.require().ca_cert.read_bytes())
    write_private(kit.out / "token", token.encode() + b"\n")
    write_public(kit.out / "ca.pem", folder.ca_cert.read_bytes())
    written = [kit.out / "token", kit.out / "ca.pem"]
    issued: x509.Certificate | None = None
    if kit.client_cert is ClientCert.ISSUE:
        key = new_private_key()
        issued = issue_site(folder, kit.site, key.public_key(), days=days)
        write_private(kit.out / "client.key", private_key_pem(key))
        write_public(kit.out / "client.pem", certificate_pem(issued))
        written += [kit.out / "client.key", kit.out / "client.pem"]
    write_public(kit.out / "site.toml", _site_toml(kit, ca, issued).encode())
    return [*written, kit.out / "site.toml"]


def _site_toml(kit: Kit, ca: x509.Certificate, issued: x509.Certificate | None) -> str:
    """site.toml with the kit's paths, the steps left to the site, and a [[data]] example."""
    config = kit.install_dir / "site.toml"
    steps = [
        f"cardiofl site keygen --out {kit.install_dir / 'store.key'}   # once: the key of the encrypted store",
        "describe the site's ECG sources in the [[data]] table at the end (deploy/site.example.toml has every option)",
    ]
    if kit.client_cert is ClientCert.CSR:
        steps += [
            f"cardiofl site tls request --config {config} --out {kit.site}.csr   # the key stays here (client_key)",
            f"send {kit.site}.csr to the coordinator's admin; put the certificate they return at client_cert",
        ]
    steps.append(f"cardiofl site run --config {config}")
    client = "# " if kit.client_cert is ClientCert.NONE else ""
    settings = [
        (f"name = {json.dumps(kit.site)}", "as enrolled at the coordinator"),
        (f"coordinator_url = {json.dumps(kit.url)}", ""),
        (f"token_file = {kit.at_site('token')}", "the site token, mode 600"),
        (f"ca_bundle = {kit.at_site('ca.pem')}", "the coordinator's CA"),
        (f"{client}client_cert = {kit.at_site('client.pem')}", "mutual TLS: this site's certificate"),
        (f"{client}client_key = {kit.at_site('client.key')}", "... and its key, mode 600"),
        (f"store_key_file = {kit.at_site('store.key')}", "step 1 makes it"),
        (f"store_dir = {kit.at_site('store')}", "the encrypted store of phi_k"),
        (f"cache_dir = {kit.at_site('cache')}", "preprocessed records"),
        (f"heartbeat_file = {kit.at_site('heartbeat')}", "`cardiofl site health` reads it"),
    ]
    lines = [
        f"# cardiofl site agent settings for site {kit.site!r}, from `cardiofl coordinator tls site-kit`",
        f"# ({utc_now():%Y-%m-%d}). Install this folder at {kit.install_dir}; then:",
        *(f"#   {number}. {step}" for number, step in enumerate(steps, 1)),
        f"# The coordinator's CA: {describe(ca)}",
        f"#   SHA-256 fingerprint {fingerprint(ca)} (compare it with the admin's)",
    ]
    if issued is not None:
        lines.append(f"# This site's client certificate: {describe(issued)}")
    width = max(len(setting) for setting, _ in settings) + 2
    lines += ["", *(f"{setting:<{width}}# {note}" if note else setting for setting, note in settings), ""]
    lines += [
        "# [[data]]",
        '# kind = "challenge"          # or "ptbxl" (ptbxl_database.csv), or "manifest" (a CSV of record,labels)',
        '# path = "/data/WFDB_Ga"',
        "",
    ]
    return "\n".join(lines)
