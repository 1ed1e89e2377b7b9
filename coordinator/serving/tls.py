"""HTTPS under uvicorn: a TLS context that re-reads renewed certificates and CRLs, without a restart.

uvicorn builds its SSLContext once per worker. Ours watches the files it was built from; at the
first handshake after one changed (checked at most once a second) it builds a new context and
hands the handshake to it (the SNI callback runs for every ClientHello). Established connections
keep the context they started with, so with mutual TLS every response closes its connection: the
next request is a new handshake, checked against the newest CRL.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509

from shared.tls import describe

if TYPE_CHECKING:
    import uvicorn

__all__ = ["CloseConnections", "ReloadingContext", "uvicorn_tls_options"]

log = logging.getLogger("uvicorn.error")  # configured before the app is: the first context is built earlier

CHECK_INTERVAL_S = 1.0
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class ReloadingContext:
    """uvicorn's `ssl_context_factory`: plain data, so it travels to spawned workers."""

    def __init__(self, crl_file: str | None = None, check_interval_s: float = CHECK_INTERVAL_S) -> None:
        self.crl_file = crl_file
        self.check_interval_s = check_interval_s

    def __call__(self, config: uvicorn.Config, default_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        """Build the first context from uvicorn's settings; it re-reads the files when they change."""
        files = [f for f in (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, self.crl_file) if f]
        watcher = _Watcher(lambda: self._build(default_factory), [Path(f) for f in files], self.check_interval_s)
        assert config.ssl_certfile is not None  # else the first build above failed: uvicorn's factory needs it
        try:
            served = describe(x509.load_pem_x509_certificate(Path(config.ssl_certfile).read_bytes()))
        except ValueError:  # OpenSSL read it; a file cryptography does not is still served
            served = str(config.ssl_certfile)
        mutual = config.ssl_cert_reqs == ssl.CERT_REQUIRED
        mode = "a client certificate from its CA required" if mutual else "no client certificate asked for"
        log.info("TLS: serving %s; %s; renewed files are picked up without a restart", served, mode)
        return watcher.base

    def _build(self, default_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        context = default_factory()
        if self.crl_file:
            context.load_verify_locations(self.crl_file)
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        return context


class _Watcher:
    """The context uvicorn listens with, and the newest one built from the files, swapped in at each ClientHello."""

    def __init__(self, build: Callable[[], ssl.SSLContext], files: list[Path], interval_s: float) -> None:
        self.build, self.files, self.interval_s = build, files, interval_s
        self.signature = self._signature()
        self.base = self.current = build()
        self.base.sni_callback = self._on_hello
        self.checked = time.monotonic()
        self.failure: str | None = None

    def _signature(self) -> tuple[tuple[int, int, int], ...]:
        stats = [os.stat(path) for path in self.files]
        return tuple((stat.st_ino, stat.st_size, stat.st_mtime_ns) for stat in stats)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self.checked < self.interval_s:
            return
        self.checked = now
        try:
            signature = self._signature()
            if signature == self.signature:
                return
            self.current = self.build()
        except (OSError, ssl.SSLError, ValueError) as exc:  # a file half replaced: try again next time
            if str(exc) != self.failure:
                log.warning("TLS files changed but do not load (%s); keeping the previous ones", exc)
            self.failure = str(exc)
            return
        self.signature, self.failure = signature, None
        log.info("TLS: reloaded %s", ", ".join(path.name for path in self.files))

    def _on_hello(self, connection: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: Any) -> None:
        try:
            self._refresh()
            if self.current is not self.base:
                connection.context = self.current
        except Exception:  # never fail a handshake over reloading: the previous context still serves
            log.exception("TLS: could not switch to the reloaded context")


class CloseConnections:
    """ASGI wrapper adding `Connection: close` to every response: the next request is a fresh, checked handshake."""

    def __init__(self, app: Callable[[Scope, Any, Any], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Callable[[Message], Awaitable[None]]) -> None:
        """Pass the request on; mark its response to close the connection."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)


def uvicorn_tls_options(
    certfile: Path, keyfile: Path | None, *, ca_file: Path | None = None, crl_file: Path | None = None
) -> dict[str, Any]:
    """uvicorn.run's TLS keywords; with `ca_file` (and its CRL) a client certificate is required."""
    return {
        "ssl_certfile": str(certfile),
        "ssl_keyfile": str(keyfile) if keyfile else None,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if ca_file else ssl.CERT_NONE,
        "ssl_ca_certs": str(ca_file) if ca_file else None,
        "ssl_context_factory": ReloadingContext(str(crl_file) if crl_file else None),
    }
