"""A coordinator served by uvicorn on 127.0.0.1 in a background thread, for browsers and CLIs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn

from cardiofl.demo import free_port
from coordinator.config import CoordinatorSettings
from coordinator.main import create_app
from tests.conftest import ADMIN_TOKEN
from tests.coordinator.factories import site_headers


@dataclass
class LiveCoordinator:
    """Where the live coordinator listens and how to call it as the bootstrap admin."""

    url: str
    admin_token: str
    clients: list[httpx.Client] = field(default_factory=list)

    def client(self, token: str | None = None) -> httpx.Client:
        """An httpx client with a bearer token (the admin's by default), closed with the server.

        It sends the protocol version as a site agent does; the coordinator reads it from sites only.
        """
        client = httpx.Client(base_url=self.url, headers=site_headers(token or self.admin_token))
        self.clients.append(client)
        return client


@pytest.fixture()
def live_coordinator(coordinator_settings: CoordinatorSettings) -> Iterator[LiveCoordinator]:
    """The coordinator app under a real uvicorn server on a free port."""
    port = free_port()
    app = create_app(coordinator_settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    live = LiveCoordinator(f"http://127.0.0.1:{port}", ADMIN_TOKEN)
    try:
        yield live
    finally:
        for client in live.clients:
            client.close()
        server.should_exit = True
        thread.join(timeout=20)
