"""`cardiofl site run` against a coordinator that no longer serves its protocol: one line, exit code 4."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.wire.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_HEADER, PROTOCOL_VERSION
from tests.site_agent.test_startup_data import agent_config, valid_source


class _TooNew(BaseHTTPRequestHandler):
    """A coordinator that serves only agents newer than this one; it notes the versions it was sent."""

    versions: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook
        self.versions.append(self.headers.get(PROTOCOL_HEADER))
        body = json.dumps(
            {"error": {"code": "agent_too_old", "message": "upgrade the site agent (cardiofl) to the coordinator's"}}
        ).encode()
        self.send_response(426)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        """Quiet."""


@pytest.fixture()
def too_new_coordinator() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TooNew)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_agent_the_coordinator_no_longer_serves_stops_with_one_line(
    too_new_coordinator: str, tmp_path: Path
) -> None:
    assert MIN_PROTOCOL_VERSION <= PROTOCOL_VERSION
    config = agent_config(tmp_path, [valid_source("challenge", tmp_path)])
    config.write_text(config.read_text().replace("http://127.0.0.1:9", too_new_coordinator))
    agent = subprocess.run(
        [sys.executable, "-m", "cardiofl", "site", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert agent.returncode == 4, agent.stderr
    errors = [line for line in agent.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "upgrade the site agent" in errors[0], agent.stderr
    assert "Traceback" not in agent.stderr
    assert _TooNew.versions and set(_TooNew.versions) == {str(PROTOCOL_VERSION)}
