"""An ASGI app under a real uvicorn server on a free port of 127.0.0.1, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

__all__ = ["served"]


@contextmanager
def served(app: Any) -> Iterator[tuple[str, int]]:
    """(host, port) where `app` answers, lifespan included, until the block ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield listener.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        listener.close()
