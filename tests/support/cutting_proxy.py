"""A TCP proxy in front of a server that cuts one connection once, N body bytes into a message, counting every byte.

`CuttingProxy(target, cut_after=N, direction="down")` forwards connections from its own port on
127.0.0.1 to `target`. The first time a message going `direction` ("down": server to client, a
response; "up": client to server, a request) has N bytes of body past its head (the blank line
ending its headers), the proxy forwards exactly those N, then closes both sides of that connection.
Later connections pass untouched. `read` and `forwarded` count the bytes taken from each side and
passed on, per direction, over all connections.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

__all__ = ["CuttingProxy", "Direction", "cutting_proxy"]

Direction = Literal["up", "down"]
HEAD_END = b"\r\n\r\n"
RECV_BYTES = 64 << 10


class CuttingProxy:
    """127.0.0.1:`port` forwarded to `target`; one connection cut `cut_after` body bytes into a message `direction`."""

    def __init__(self, target: tuple[str, int], *, cut_after: int | None, direction: Direction = "down") -> None:
        self.target, self.cut_after, self.direction = target, cut_after, direction
        self.read: dict[Direction, int] = {"up": 0, "down": 0}
        self.forwarded: dict[Direction, int] = {"up": 0, "down": 0}
        self.cuts = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._start(self._accept)

    @property
    def url(self) -> str:
        """The proxy's address as an http URL."""
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop accepting and close every connection."""
        _close(self._listener, *self._sockets)  # a shut-down listener wakes its accept()
        for thread in self._threads:
            thread.join(timeout=5)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            self._start(self._pump, client, server, "up")
            self._start(self._pump, server, client, "down")

    def _pump(self, source: socket.socket, sink: socket.socket, direction: Direction) -> None:
        """Copy `source` to `sink` until either closes; close both at the cut, if it falls in this stream."""
        body = _BodyBytes()
        while True:
            try:
                data = source.recv(RECV_BYTES)
            except OSError:
                data = b""
            if not data:
                _close(source, sink)
                return
            with self._lock:
                self.read[direction] += len(data)
                armed = direction == self.direction and self.cut_after is not None and self.cuts == 0
                keep = body.cut_point(data, self.cut_after) if armed and self.cut_after is not None else None
                if keep is not None:
                    self.cuts += 1
            send = data if keep is None else data[:keep]
            try:
                sink.sendall(send)
            except OSError:
                keep = 0
            with self._lock:
                self.forwarded[direction] += len(send)
            if keep is not None:
                _close(source, sink)
                return


class _BodyBytes:
    """The body bytes of the first message one way: counted from the blank line that ends its head."""

    def __init__(self) -> None:
        self.head = b""
        self.body = -1  # still in the head

    def cut_point(self, data: bytes, limit: int) -> int | None:
        """How many bytes of `data` pass before the body holds `limit` bytes, cutting there; None: all, no cut yet."""
        offset = 0
        if self.body < 0:
            self.head += data
            end = self.head.find(HEAD_END)
            if end < 0:
                return None
            offset = len(data) - (len(self.head) - end - len(HEAD_END))
            self.body = 0
        room = limit - self.body
        if len(data) - offset < room:
            self.body += len(data) - offset
            return None
        return offset + room


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


@contextmanager
def cutting_proxy(
    target: tuple[str, int], *, cut_after: int | None, direction: Direction = "down"
) -> Iterator[CuttingProxy]:
    """A CuttingProxy, closed afterwards."""
    proxy = CuttingProxy(target, cut_after=cut_after, direction=direction)
    try:
        yield proxy
    finally:
        proxy.close()
