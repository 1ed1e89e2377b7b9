"""The researcher's commands against a coordinator they cannot talk to: one line that names the fix."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client.http import unreachable
from coordinator.pki.tls import TlsFolder, init_folder

runner = CliRunner()


class _Studies(BaseHTTPRequestHandler):
    """A coordinator with no study: every GET answers an empty page."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"data": [], "count": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        """Quiet."""


@pytest.fixture()
def https(tmp_path: Path) -> Iterator[tuple[str, TlsFolder]]:
    """An HTTPS coordinator on 127.0.0.1 whose certificate a private CA signed: (its port, the CA's folder)."""
    folder = init_folder(tmp_path / "tls", ["127.0.0.1"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder.server_cert, folder.server_key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Studies)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", folder
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def studies(url: str, **env: str) -> tuple[int, str]:
    result = runner.invoke(app, ["study", "list", "--url", url, "--json"], env={"CARDIOFL_CA_BUNDLE": "", **env})
    return result.exit_code, result.output


def test_an_untrusted_certificate_names_the_ca_bundle_variable(https: tuple[str, TlsFolder]) -> None:
    host, folder = https
    code, output = studies(f"https://{host}")
    assert code != 0
    (line,) = output.strip().splitlines()
    assert line.startswith(f"error: the coordinator at https://{host}") and "CERTIFICATE_VERIFY_FAILED" in line
    assert "set CARDIOFL_CA_BUNDLE to the coordinator's CA certificate" in line
    code, output = studies(f"https://{host}", CARDIOFL_CA_BUNDLE=str(folder.ca_cert))  # the fix it names
    assert code == 0 and json.loads(output) == [], output


def test_plain_http_to_an_https_coordinator_says_to_use_https(https: tuple[str, TlsFolder]) -> None:
    host, folder = https
    code, output = studies(f"http://{host}")
    assert code != 0
    (line,) = output.strip().splitlines()
    assert f"the coordinator at http://{host}" in line and "may speak https" in line
    assert f"use https://{host} (--url or CARDIOFL_URL)" in line
    code, output = studies(f"https://{host}", CARDIOFL_CA_BUNDLE=str(folder.ca_cert))
    assert code == 0, output


def test_nothing_listening_is_said_as_before() -> None:
    code, output = studies("http://127.0.0.1:9")
    assert code != 0 and "cannot reach the coordinator at http://127.0.0.1:9" in output


def test_a_dropped_connection_over_http_suggests_https_with_the_same_host_and_port() -> None:
    dropped = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    line = unreachable(httpx.URL("http://coordinator.example.org:8443/"), dropped)
    assert line == (
        "the coordinator at http://coordinator.example.org:8443/ closed the connection without answering "
        "(Server disconnected without sending a response.): it may speak https: "
        "use https://coordinator.example.org:8443 (--url or CARDIOFL_URL)"
    )
    assert "may speak" not in unreachable(httpx.URL("https://coordinator.example.org/"), dropped)
