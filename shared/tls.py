"""Keys and certificate files as both sides handle them: new keys, private files (mode 600), readable summaries."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import ssl
import tempfile
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes, PublicKeyTypes
from cryptography.x509.oid import NameOID

from shared.errors import FormatError

__all__ = [
    "PrivateKey",
    "certificate_pem",
    "check_public_key",
    "client_ssl_context",
    "common_name",
    "describe",
    "fingerprint",
    "key_matches",
    "load_private_key",
    "new_private_key",
    "private_key_pem",
    "utc_now",
    "write_private",
    "write_public",
]

PrivateKey = CertificateIssuerPrivateKeyTypes
MIN_RSA_BITS = 2048
EC_CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)


def utc_now() -> dt.datetime:
    """Now, in UTC (certificate times are UTC)."""
    return dt.datetime.now(dt.UTC)


def new_private_key() -> ec.EllipticCurvePrivateKey:
    """A new ECDSA P-256 key: small, fast to verify, accepted by every TLS 1.2+ stack."""
    return ec.generate_private_key(ec.SECP256R1())


def private_key_pem(key: PrivateKey) -> bytes:
    """The key as unencrypted PKCS#8 PEM (the file holding it is mode 600)."""
    pkcs8 = serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption())


def certificate_pem(certificate: x509.Certificate) -> bytes:
    """The certificate as PEM."""
    return certificate.public_bytes(serialization.Encoding.PEM)


def load_private_key(path: Path) -> PrivateKey:
    """A PEM private key without a password; ValueError says what is wrong with the file."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except TypeError:
        raise FormatError(f"{path} is encrypted; cardiofl reads keys without a password (mode 600)") from None
    except ValueError:
        raise FormatError(f"{path} holds no PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise FormatError(f"{path} holds a {type(key).__name__}; cardiofl uses ECDSA or RSA keys")
    return key


def check_public_key(key: PublicKeyTypes) -> None:
    """Accept ECDSA on P-256/384/521 and RSA of at least 2048 bits; ValueError otherwise."""
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, EC_CURVES):
        return
    if isinstance(key, rsa.RSAPublicKey) and key.key_size >= MIN_RSA_BITS:
        return
    raise FormatError(f"a {type(key).__name__} is not accepted: use ECDSA P-256 (or P-384) or RSA of 2048+ bits")


def key_matches(certificate: x509.Certificate, key: PrivateKey) -> bool:
    """Whether `key` is the private half of the certificate's public key."""
    pem = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    return certificate.public_key().public_bytes(*pem) == key.public_key().public_bytes(*pem)


def common_name(name: x509.Name) -> str | None:
    """The (single) CN of a subject, or None."""
    values = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(values[0].value) if len(values) == 1 else None


def fingerprint(certificate: x509.Certificate) -> str:
    """SHA-256 of the certificate, as colon-separated hex (compare it out of band)."""
    return certificate.fingerprint(hashes.SHA256()).hex(":").upper()


def describe(certificate: x509.Certificate) -> str:
    """'CN=lyon, serial 1A2B…, valid until 2027-01-31 12:00 UTC' for messages."""
    until = certificate.not_valid_after_utc.strftime("%Y-%m-%d %H:%M UTC")
    return f"CN={common_name(certificate.subject)}, serial {certificate.serial_number:X}, valid until {until}"


def _write(path: Path, data: bytes, mode: int, *, replace: bool) -> None:
    """Write `data` to a new file beside `path` with `mode`, then rename it into place (never a half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not replace and path.exists():
        raise FileExistsError(f"{path} exists; refusing to overwrite it")
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(handle, mode)
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if replace:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)  # fails if `path` appeared meanwhile
            os.unlink(temporary)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_private(path: Path, data: bytes, *, replace: bool = False) -> None:
    """A secret (key, token) readable by its owner only, written atomically; existing files only with `replace`."""
    _write(path, data, 0o600, replace=replace)


def write_public(path: Path, data: bytes, *, replace: bool = False) -> None:
    """A certificate, CRL or config file (mode 644), written atomically; existing files only with `replace`."""
    _write(path, data, 0o644, replace=replace)


def client_ssl_context(
    ca_bundle: str | Path | None, client_cert: str | Path | None, client_key: str | Path | None, *, verify: bool = True
) -> ssl.SSLContext:
    """A client's TLS context: trust `ca_bundle` (else httpx's default CAs), present the certificate if given."""
    if ca_bundle is not None and verify:
        context = ssl.create_default_context(cafile=str(ca_bundle))
    else:  # httpx's own: certifi's CAs (or SSL_CERT_FILE), or no verification at all
        context = httpx.create_ssl_context(verify=verify)
    if client_cert is not None and client_key is not None:
        context.load_cert_chain(client_cert, client_key)
    return context
