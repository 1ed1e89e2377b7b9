"""The served protocol hands a request body to the app whole, joining its pieces once (serving/header_deadline.py)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http import httptools_impl

from coordinator.serving.header_deadline import BodyChunks, HeaderDeadlineProtocol


def test_body_chunks_keep_the_pieces_and_join_them_once() -> None:
    body = BodyChunks()
    assert len(body) == 0 and bytes(body) == b""
    first = b"a" * 70_000
    body += first
    assert len(body) == 70_000 and bytes(body) is first  # one piece: handed over as it is
    body += b"bc"
    assert len(body) == 70_002 and bytes(body) == first + b"bc"


class _Recorder:
    """An ASGI app that reads each request's body and answers its sha256; it keeps the size of each message."""

    def __init__(self) -> None:
        self.messages: list[tuple[type, int]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        digest, more = hashlib.sha256(), True
        while more:
            message = await receive()
            self.messages.append((type(message["body"]), len(message["body"])))
            digest.update(message["body"])
            more = message.get("more_body", False)
        answer = digest.hexdigest().encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"64")]})
        await send({"type": "http.response.body", "body": answer})


@contextmanager
def _served(app: _Recorder) -> Iterator[str]:
    listener = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=HeaderDeadlineProtocol, ws="none", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    give_up = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < give_up and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        host, port = listener.getsockname()[:2]
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        listener.close()


def test_an_upload_reaches_the_app_whole_and_as_bytes_through_the_served_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httptools_impl, "HIGH_WATER_LIMIT", 4 << 20)  # as a served coordinator reads ahead
    app = _Recorder()
    body = os.urandom(24 << 20)
    with _served(app) as url:

        def pieces() -> Iterator[bytes]:
            for start in range(0, len(body), 1 << 20):
                yield body[start : start + (1 << 20)]
                time.sleep(0.001)

        answer = httpx.post(url, content=pieces(), headers={"content-length": str(len(body))}, timeout=60)
    assert answer.status_code == 200 and answer.content.decode() == hashlib.sha256(body).hexdigest()
    assert {kind for kind, _ in app.messages} == {bytes}
    assert sum(size for _, size in app.messages) == len(body)
