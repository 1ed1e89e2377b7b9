"""Ask a coordinator's GET /api/v1/status once a second, printing each answer's latency in seconds, until stopped.

A process of its own, so that what it measures is the coordinator's latency and not the load
generator's: `bench/scale.py` runs K simulated sites in one busy event loop. A line is the
latency of an answer 200, else `error <what>`. The admin token is read from CARDIOFL_ADMIN_TOKEN;
under mutual TLS the CA, client certificate and key files follow the URL on the command line.
"""

from __future__ import annotations

import os
import ssl
import sys
import time

import httpx


def main(url: str, tls: list[str]) -> None:
    """Probe `url` until killed; `tls`: none, or the CA, client certificate and key files for mutual TLS."""
    headers = {"Authorization": f"Bearer {os.environ['CARDIOFL_ADMIN_TOKEN']}"}
    verify: ssl.SSLContext | bool = True
    if tls:
        verify = ssl.create_default_context(cafile=tls[0])
        verify.load_cert_chain(tls[1], tls[2])
    with httpx.Client(base_url=url, headers=headers, timeout=60.0, verify=verify) as client:
        while True:
            start = time.perf_counter()
            try:
                response = client.get("/api/v1/status")
                answered = response.status_code
                line = f"{time.perf_counter() - start:.4f}" if answered == 200 else f"error admin status: {answered}"
            except httpx.TransportError as exc:
                line = f"error admin status: dropped: {type(exc).__name__}"
            print(line, flush=True)
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - start)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
