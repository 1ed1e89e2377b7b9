"""The coordinator's private CA in one folder: its server certificate, site certificates, renewals and the CRL.

Layout (docs/hospital-it/tls.md): ca.pem, ca.key (600), server.pem, server.key (600), crl.pem, and issued/, a
copy of every certificate the CA signed (by serial), from which renewals and revocations work.
Private keys of sites are never kept here.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.tls import (
    PrivateKey,
    certificate_pem,
    check_public_key,
    common_name,
    load_private_key,
    new_private_key,
    private_key_pem,
    utc_now,
    write_private,
    write_public,
)

__all__ = [
    "CERT_DAYS",
    "Issued",
    "TlsError",
    "TlsFolder",
    "certificates_of",
    "init_folder",
    "issue_server",
    "issue_site",
    "issued",
    "public_key_of_csr",
    "revoke",
    "server_hosts",
]

CA_DAYS = 3650
CERT_DAYS = 397
SKEW = dt.timedelta(minutes=5)  # certificates start a little in the past: clocks differ


class TlsError(Exception):
    """A TLS folder, request or certificate that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class TlsFolder:
    """Where the CA's files live; `require()` checks that `cardiofl coordinator tls init` made them."""

    path: Path

    @property
    def ca_cert(self) -> Path:
        """The CA certificate: the sites' `ca_bundle`, and the issuer of client certificates."""
        return self.path / "ca.pem"

    @property
    def ca_key(self) -> Path:
        """The CA's private key (mode 600); whoever holds it can issue certificates."""
        return self.path / "ca.key"

    @property
    def server_cert(self) -> Path:
        """The coordinator's certificate (uvicorn's ssl_certfile)."""
        return self.path / "server.pem"

    @property
    def server_key(self) -> Path:
        """The coordinator's private key (mode 600)."""
        return self.path / "server.key"

    @property
    def crl(self) -> Path:
        """The certificate revocation list the coordinator checks client certificates against."""
        return self.path / "crl.pem"

    @property
    def issued_dir(self) -> Path:
        """A copy of every certificate the CA issued, named by serial."""
        return self.path / "issued"

    def require(self, *paths: Path) -> TlsFolder:
        """The folder, once `paths` (default: all its files) are found to exist; TlsError names one missing."""
        for path in paths or (self.ca_cert, self.ca_key, self.server_cert, self.server_key, self.crl):
            if not path.is_file():
                raise TlsError(f"{path} is missing: {self.path} is not a folder of `cardiofl coordinator tls init`")
        return self

    def ca(self) -> tuple[x509.Certificate, PrivateKey]:
        """The CA's certificate and key."""
        self.require(self.ca_cert, self.ca_key)
        return x509.load_pem_x509_certificate(self.ca_cert.read_bytes()), load_private_key(self.ca_key)


def _name(common: str) -> x509.Name:
    attributes = [
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cardiofl"),
        x509.NameAttribute(NameOID.COMMON_NAME, common),
    ]
    return x509.Name(attributes)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates and CRLs; a TLS certificate signs handshakes only (TLS 1.2+ with (EC)DHE)."""
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host or host.startswith(("-", ".")) or any(c.isspace() or c in "/:@" for c in host):
        raise TlsError(f"{host!r} is neither a host name nor an IP address")
    return x509.DNSName(host.encode("idna").decode("ascii"))


def _leaf(
    folder: TlsFolder,
    common: str,
    public_key: CertificatePublicKeyTypes,
    usage: list[x509.ObjectIdentifier],
    days: int,
    now: dt.datetime | None,
    hosts: list[str] | None = None,
) -> x509.Certificate:
    """Sign an end-entity certificate with the folder's CA and keep a copy in issued/."""
    ca_cert, ca_key = folder.ca()
    start = (now or utc_now()) - SKEW
    end = min(start + SKEW + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in hosts]), critical=False)
    certificate = builder.sign(ca_key, hashes.SHA256())
    write_public(folder.issued_dir / f"{certificate.serial_number:X}.pem", certificate_pem(certificate))
    return certificate


def init_folder(
    path: Path, hosts: list[str], *, days: int = CERT_DAYS, ca_days: int = CA_DAYS, now: dt.datetime | None = None
) -> TlsFolder:
    """Create the CA, the server certificate for `hosts` (DNS names or IPs) and an empty CRL in a new folder."""
    folder = TlsFolder(path)
    if folder.ca_key.exists():
        raise TlsError(f"{folder.ca_key} exists: this folder already holds a CA (delete the folder to start over)")
    if not hosts:
        raise TlsError("name at least one --host the sites reach the coordinator by (a DNS name or an IP address)")
    for host in hosts:
        _alt_name(host)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    key = new_private_key()
    start = (now or utc_now()) - SKEW
    name = _name(f"cardiofl CA {hosts[0]}"[:64])  # a CN holds 64 characters at most
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + SKEW + dt.timedelta(days=ca_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(folder.ca_key, private_key_pem(key))
    write_public(folder.ca_cert, certificate_pem(ca_cert))
    _write_crl(folder, [], now)
    issue_server(folder, hosts, days=days, new_key=True, now=now)
    return folder


def issue_server(
    folder: TlsFolder, hosts: list[str], *, days: int = CERT_DAYS, new_key: bool = False, now: dt.datetime | None = None
) -> x509.Certificate:
    """A server certificate for `hosts`, replacing server.pem (and server.key with `new_key`, or when there is none)."""
    if not hosts:
        raise TlsError("name at least one --host for the server certificate")
    key = new_private_key() if new_key or not folder.server_key.exists() else load_private_key(folder.server_key)
    # Client authentication too: the container's health check presents it to a coordinator under mutual TLS.
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    certificate = _leaf(folder, hosts[0][:64], key.public_key(), usage, days, now, hosts)
    if new_key or not folder.server_key.exists():
        write_private(folder.server_key, private_key_pem(key), replace=True)
    write_public(folder.server_cert, certificate_pem(certificate), replace=True)
    return certificate


def server_hosts(folder: TlsFolder) -> list[str]:
    """The host names and addresses the current server certificate is valid for."""
    certificate = x509.load_pem_x509_certificate(folder.require().server_cert.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(value) for value in names.get_values_for_type(x509.DNSName)] + [
        str(value) for value in names.get_values_for_type(x509.IPAddress)
    ]


def issue_site(
    folder: TlsFolder,
    site: str,
    public_key: CertificatePublicKeyTypes,
    *,
    days: int = CERT_DAYS,
    now: dt.datetime | None = None,
) -> x509.Certificate:
    """A client certificate for `site` (CN = its name) over the site's public key."""
    try:
        check_public_key(public_key)
    except ValueError as exc:
        raise TlsError(str(exc)) from None
    return _leaf(folder, site, public_key, [ExtendedKeyUsageOID.CLIENT_AUTH], days, now)


def public_key_of_csr(request_pem: bytes, site: str) -> CertificatePublicKeyTypes:
    """The public key of a site's certificate signing request, after checking its signature, key and name."""
    try:
        request = x509.load_pem_x509_csr(request_pem)
    except ValueError:
        raise TlsError("not a PEM certificate signing request (make one with `cardiofl site tls request`)") from None
    if not request.is_signature_valid:
        raise TlsError("the request's signature is invalid: it was not made with the key it names")
    name = common_name(request.subject)
    if name != site:
        raise TlsError(f"the request is for CN={name!r}, not site {site!r}: refusing to sign it")
    public_key = request.public_key()
    try:
        check_public_key(public_key)
    except ValueError as exc:
        raise TlsError(str(exc)) from None
    return public_key


@dataclass(frozen=True)
class Issued:
    """A certificate the CA issued, whether it is a site's, and when it was revoked (None: it was not)."""

    certificate: x509.Certificate
    site: bool
    revoked_at: dt.datetime | None

    @property
    def name(self) -> str:
        """The site's name, or the server's first host."""
        return common_name(self.certificate.subject) or "?"


def _revoked(folder: TlsFolder) -> dict[int, dt.datetime]:
    crl = x509.load_pem_x509_crl(folder.require().crl.read_bytes())
    return {entry.serial_number: entry.revocation_date_utc for entry in crl}


def issued(folder: TlsFolder) -> list[Issued]:
    """Every certificate the CA issued, oldest first."""
    revoked = _revoked(folder)
    found = []
    for path in sorted(folder.issued_dir.glob("*.pem")):
        certificate = x509.load_pem_x509_certificate(path.read_bytes())
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        site = ExtendedKeyUsageOID.SERVER_AUTH not in usage  # a client's: a site's, or a person's (`tls client`)
        found.append(Issued(certificate, site, revoked.get(certificate.serial_number)))
    return sorted(found, key=lambda item: item.certificate.not_valid_before_utc)


def certificates_of(folder: TlsFolder, site: str) -> list[Issued]:
    """The site's certificates, oldest first."""
    return [item for item in issued(folder) if item.site and item.name == site]


def revoke(folder: TlsFolder, serials: list[int], *, now: dt.datetime | None = None) -> None:
    """Add `serials` to the CRL (atomically replaced: the coordinator picks it up at its next handshake)."""
    revoked = _revoked(folder)
    revoked.update({serial: revoked.get(serial, now or utc_now()) for serial in serials})
    _write_crl(folder, sorted(revoked.items()), now)


def _write_crl(folder: TlsFolder, revoked: list[tuple[int, dt.datetime]], now: dt.datetime | None) -> None:
    """Sign a CRL valid as long as the CA: an out-of-date CRL would lock every site out."""
    ca_cert, ca_key = folder.ca()
    number = 0
    if folder.crl.exists():
        previous = x509.load_pem_x509_crl(folder.crl.read_bytes())
        number = previous.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number + 1
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update((now or utc_now()) - SKEW)
        .next_update(ca_cert.not_valid_after_utc)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    for serial, when in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    write_public(folder.crl, crl.public_bytes(serialization.Encoding.PEM), replace=True)
