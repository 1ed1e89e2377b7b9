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

from coordinator.serving.body_pieces import BodyPieces, declared_length
from coordinator.serving.header_deadline import HeaderDeadlineProtocol


def test_body_pieces_hand_over_the_pieces_themselves_oldest_first() -> None:
    body = BodyPieces()
    assert len(body) == 0 and body.take() == b""
    first, second = b"a" * 70_000, b"bc"
    body += first
    body += b""
    body += second
    assert len(body) == 70_002
    assert body.take() is first and len(body) == 2
    assert body.take() is second and len(body) == 0 and body.take() == b""


@pytest.mark.parametrize(
    ("headers", "length"),
    [
        ([(b"content-length", b"12")], 12),
        ([(b"host", b"x"), (b"content-length", b"0")], 0),
        ([], 0),
        ([(b"content-length", b"12"), (b"content-length", b"12")], 0),  # several: left to the parser
        ([(b"content-length", b"12"), (b"transfer-encoding", b"chunked")], 0),
        ([(b"content-length", b"-1")], 0),
    ],
)
def test_the_declared_length_is_one_plain_content_length(headers: list[tuple[bytes, bytes]], length: int) -> None:
    assert declared_length(headers) == length


class _Recorder:
    """An ASGI app that reads each request's body and answers its sha256; it keeps the size of each message.

    At /refuse it answers "refused" without reading the body.
    """

    def __init__(self, *, keep_bodies: bool = False) -> None:
        self.messages: list[tuple[type, int]] = []
        self.bodies: list[bytes] = []
        self.keep_bodies = keep_bodies

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        digest, more = hashlib.sha256(), scope["path"] != "/refuse"
        while more:
            message = await receive()
            self.messages.append((type(message["body"]), len(message["body"])))
            if self.keep_bodies:
                self.bodies.append(message["body"])
            digest.update(message["body"])
            more = message.get("more_body", False)
        answer = digest.hexdigest().encode() if scope["path"] != "/refuse" else b"refused".ljust(64, b".")
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


def test_a_body_past_its_header_reaches_the_app_as_the_objects_the_transport_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received: list[bytes] = []  # every object handed to the protocol, kept alive so that ids stay unique
    original = HeaderDeadlineProtocol.data_received

    def recording(self: HeaderDeadlineProtocol, data: bytes) -> None:
        received.append(data)
        original(self, data)

    monkeypatch.setattr(HeaderDeadlineProtocol, "data_received", recording)
    app = _Recorder(keep_bodies=True)
    body = os.urandom(8 << 20)
    with _served(app) as url:
        answer = httpx.post(url, content=body, timeout=60)
    assert answer.content.decode() == hashlib.sha256(body).hexdigest()
    pieces = [piece for piece in app.bodies if piece]
    assert len(pieces) > 2
    transported = {id(data) for data in received}
    # the first piece shares its read with the header (the parser hands it on); the last may be cut off
    # the next request's bytes; every other one is a read of the transport, not a copy of it
    assert all(id(piece) in transported for piece in pieces[1:-1])


def _exchange(url: str, raw: bytes, answers: int) -> list[bytes]:
    """Send `raw` on one connection at once; the bodies of the first `answers` responses (each 64 bytes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(raw)
        data = b""
        while data.count(b"HTTP/1.1 200") < answers or len(data.rsplit(b"\r\n\r\n", 1)[-1]) < 64:
            more = connection.recv(1 << 16)
            assert more, f"the connection closed after {data!r}"
            data += more
    return [part[:64] for part in data.split(b"\r\n\r\n")[1:]]


def _post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = [f"POST {path} HTTP/1.1".encode(), b"host: test", b"content-length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def test_requests_after_a_counted_off_body_on_one_connection_are_parsed_as_sent() -> None:
    app = _Recorder()
    first, second, third = os.urandom(3 << 20), os.urandom(5_000), b""
    raw = _post("/", first) + _post("/", second) + _post("/", third)  # one write: bodies run into the next header
    with _served(app) as url:
        answers = _exchange(url, raw, 3)
    assert answers == [hashlib.sha256(body).hexdigest().encode() for body in (first, second, third)]


def test_a_body_the_app_did_not_read_is_counted_off_and_the_next_request_is_served() -> None:
    app = _Recorder()
    unread, second = os.urandom(2 << 20), os.urandom(70_000)
    with _served(app) as url:
        answers = _exchange(url, _post("/refuse", unread) + _post("/", second), 2)
    assert answers[0] == b"refused".ljust(64, b".")
    assert answers[1] == hashlib.sha256(second).hexdigest().encode()


def test_a_chunked_body_and_one_sent_after_100_continue_arrive_whole() -> None:
    app = _Recorder()
    body = os.urandom(3 << 20)
    with _served(app) as url:

        def pieces() -> Iterator[bytes]:
            yield from (body[start : start + 100_000] for start in range(0, len(body), 100_000))

        chunked = httpx.post(url, content=pieces(), timeout=60)  # no length given: sent chunked
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as connection:
            head = _post("/", body, b"expect: 100-continue")[: -len(body)]
            connection.sendall(head)
            assert connection.recv(1 << 10).startswith(b"HTTP/1.1 100 Continue")
            connection.sendall(body)
            reply = b""
            while len(reply.rsplit(b"\r\n\r\n", 1)[-1]) < 64 or b"\r\n\r\n" not in reply:
                reply += connection.recv(1 << 16)
    digest = hashlib.sha256(body).hexdigest().encode()
    assert chunked.content == digest and reply.endswith(digest)
