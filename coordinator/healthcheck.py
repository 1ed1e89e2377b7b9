"""The container's health check: `python -m coordinator.healthcheck` asks this host's coordinator for /api/v1/health.

It imports the standard library alone (a health check runs every few seconds). Over HTTPS when
CARDIOFL_TLS_DIR is set: the chain is checked against that folder's CA, not the host name (the
check connects to 127.0.0.1, which the certificate need not name), and under mutual TLS it
presents the server's own certificate, which is issued for client authentication too.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request
from pathlib import Path

__all__ = ["main"]

TRUE = {"1", "true", "yes", "on"}


def _context(tls_dir: Path, mutual: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    context.check_hostname = False
    if mutual:
        context.load_cert_chain(tls_dir / "server.pem", tls_dir / "server.key")
    return context


def main() -> int:
    """0 when the coordinator on CARDIOFL_PORT (8000) answers its health route, else 1 with one line why."""
    port = os.environ.get("CARDIOFL_PORT") or "8000"
    tls_dir = os.environ.get("CARDIOFL_TLS_DIR")
    try:
        if tls_dir:
            mutual = (os.environ.get("CARDIOFL_TLS_MUTUAL") or "").strip().lower() in TRUE
            context = _context(Path(tls_dir), mutual)
            urllib.request.urlopen(f"https://127.0.0.1:{port}/api/v1/health", timeout=4, context=context)
        else:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/health", timeout=4)
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
