"""The agent's TLS: whom it trusts, what it presents, its certificate request, and why a handshake was refused."""

from __future__ import annotations

import datetime as dt
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from shared.tls import (
    PrivateKey,
    client_ssl_context,
    common_name,
    describe,
    key_matches,
    load_private_key,
    new_private_key,
    private_key_pem,
    utc_now,
    write_private,
    write_public,
)
from site_agent.errors import ConfigError

__all__ = ["AgentTls", "certificate_request", "http_client"]

log = logging.getLogger(__name__)

EXPIRY_WARNING = dt.timedelta(days=30)
# OpenSSL's verification codes for a chain that does not lead to a trusted CA.
UNTRUSTED = {2, 18, 19, 20, 21}
EXPIRED, NOT_YET_VALID, HOST_MISMATCH = 10, 9, 62


@dataclass(frozen=True)
class AgentTls:
    """The agent's TLS settings: the CA bundle it trusts, and its client certificate for mutual TLS."""

    ca_bundle: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    verify: bool = True

    def check(self, site: str) -> None:
        """Read every file now; ConfigError names a setting that cannot be used; warn of a certificate ending soon."""
        if self.ca_bundle is not None:
            try:
                x509.load_pem_x509_certificates(self.ca_bundle.read_bytes())
            except (OSError, ValueError):
                raise ConfigError(f"setting 'ca_bundle': {self.ca_bundle} holds no PEM certificate") from None
        if self.client_cert is None or self.client_key is None:
            return
        certificate = self._client_certificate()
        try:
            key = load_private_key(self.client_key)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"setting 'client_key': {exc}") from None
        if not key_matches(certificate, key):
            raise ConfigError(
                f"settings 'client_cert' and 'client_key': {self.client_key} is not the key of {describe(certificate)}"
            )
        if common_name(certificate.subject) != site:
            raise ConfigError(f"setting 'client_cert': {describe(certificate)} is not site {site!r}'s certificate")
        now = utc_now()
        if certificate.not_valid_before_utc > now:
            raise ConfigError(
                f"setting 'client_cert': {describe(certificate)} is not valid yet: check this machine's clock"
            )
        if certificate.not_valid_after_utc <= now:
            raise ConfigError(f"setting 'client_cert': {self._expired(certificate)}")
        if certificate.not_valid_after_utc - now < EXPIRY_WARNING:
            log.warning(
                "the client certificate %s ends soon: ask the coordinator's admin to renew it", describe(certificate)
            )

    def _client_certificate(self) -> x509.Certificate:
        assert self.client_cert is not None
        try:
            return x509.load_pem_x509_certificate(self.client_cert.read_bytes())
        except (OSError, ValueError):
            raise ConfigError(f"setting 'client_cert': {self.client_cert} holds no PEM certificate") from None

    def _expired(self, certificate: x509.Certificate) -> str:
        return (
            f"this site's client certificate {describe(certificate)} has expired; the coordinator's admin renews it "
            f"(`cardiofl coordinator tls renew --site ...`), it replaces {self.client_cert}, and the agent restarts"
        )

    def context(self) -> ssl.SSLContext:
        """The TLS context of the agent's connections."""
        return client_ssl_context(self.ca_bundle, self.client_cert, self.client_key, verify=self.verify)

    def explain(self, error: httpx.TransportError, drops_connections: Callable[[], bool]) -> str | None:
        """Why TLS refused a request, and who does what about it; None for other errors.

        A coordinator under mutual TLS that refuses a client certificate closes the connection without
        saying why (TLS 1.3 checks it after the client's handshake is done; asyncio sends no alert),
        so a dropped request counts as such a refusal only when `drops_connections()` sees a fresh
        connection dropped too.
        """
        cause: BaseException | None = error
        while cause is not None:
            if isinstance(cause, ssl.SSLCertVerificationError):
                return f"TLS: {self._server_refused(cause)}"
            if isinstance(cause, ssl.SSLError):
                plain = cause.reason == "WRONG_VERSION_NUMBER"  # an answer in plain HTTP
                hint = ": the coordinator does not speak HTTPS there (coordinator_url)" if plain else ""
                return f"TLS: the handshake failed ({cause.reason or cause}){hint}"
            cause = cause.__cause__ or cause.__context__
        if isinstance(error, httpx.RemoteProtocolError) and drops_connections():
            return f"TLS: {self._client_refused()}"
        return None

    def _server_refused(self, error: ssl.SSLCertVerificationError) -> str:
        """Why this agent did not trust the coordinator's certificate, and who does what about it."""
        code, detail = error.verify_code, error.verify_message
        if code == EXPIRED:
            return (
                f"the coordinator's certificate has expired ({detail}); its admin renews it "
                "(`cardiofl coordinator tls renew --server`) and the agent carries on by itself"
            )
        if code == NOT_YET_VALID:
            return f"the coordinator's certificate is not valid yet ({detail}): check this machine's clock"
        if code == HOST_MISMATCH:
            return f"the coordinator's certificate is not for the host in setting 'coordinator_url' ({detail})"
        if code in UNTRUSTED:
            trusted = f"setting 'ca_bundle' ({self.ca_bundle})" if self.ca_bundle else "the default trust store"
            return (
                f"the coordinator's certificate is not signed by a CA in {trusted} ({detail}); is it the kit's ca.pem?"
            )
        return f"the coordinator's certificate was refused: {detail}"

    def _client_refused(self) -> str:
        """Why the coordinator drops this agent's connections after the handshake (mutual TLS)."""
        if self.client_cert is None:
            return (
                "the coordinator drops this agent's connections after the TLS handshake: it requires a client "
                "certificate (mutual TLS), and settings 'client_cert' and 'client_key' are not set "
                "(`cardiofl site tls request` makes a key and a request for the coordinator's admin to sign)"
            )
        try:
            certificate = self._client_certificate()
        except ConfigError as exc:
            return str(exc)
        if certificate.not_valid_after_utc <= utc_now():
            return f"the coordinator refused {self._expired(certificate)}"
        return (
            f"the coordinator drops this agent's connections after the TLS handshake: it refuses this site's client "
            f"certificate {describe(certificate)}, which was revoked or is not from its CA; ask its admin "
            "(`cardiofl coordinator tls list`)"
        )


def http_client(base_url: str, token: str, tls: AgentTls, *, timeout: float = 5.0) -> httpx.Client:
    """The agent's HTTP client: the coordinator's URL, the site token, and the TLS context."""
    return httpx.Client(
        base_url=base_url.rstrip("/"),
        headers={"Authorization": f"Bearer {token}", "User-Agent": "cardiofl-site-agent"},
        verify=tls.context(),
        timeout=timeout,
    )


def certificate_request(site: str, key_file: Path, out: Path) -> bool:
    """Write a CSR for `site` signed by the key in `key_file`, made (mode 600) if missing; True if it was made."""
    made = not key_file.exists()
    key: PrivateKey
    if made:
        key = new_private_key()
        write_private(key_file, private_key_pem(key))
    else:
        key = load_private_key(key_file)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, site)])
    request = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    write_public(out, request.public_bytes(serialization.Encoding.PEM))
    return made
