"""uvicorn's HTTP protocol with a deadline on each request's header, and a request body copied once on its way.

A client that sends a header a byte at a time, or never, is disconnected.
uvicorn times out only an idle keep-alive connection after a response (`timeout_keep_alive`); a
connection that has not yet sent a whole request header is held for as long as the client likes
(neither h11 nor httptools times a header out). Each such
connection costs a file descriptor and nothing else (the event loop serves others meanwhile), but
enough of them exhaust the process's descriptors. `HeaderDeadlineProtocol` is uvicorn's HTTP
protocol that closes a connection whose request header is not complete within the deadline of the
connection's opening, or of the first byte of its next request: CARDIOFL_HEADER_TIMEOUT_S (set by
`cardiofl coordinator serve --header-timeout`), 30 s unless set (coordinator.serving.limits).

uvicorn appends each piece of a body that arrives to one growing buffer (`cycle.body += chunk`),
and hands the app a copy of it (`bytes(cycle.body)`): every byte of an upload is copied twice, and
the growing buffer moved as it grows, on the event loop. The protocol gives the cycle a
`BodyChunks` instead, which keeps the pieces as they came and joins them once when the app reads
(a single piece is handed over as it is): for a model of 94 MB, one copy on the loop instead of
two or three.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.serving.limits import header_timeout_s

__all__ = ["BodyChunks", "HeaderDeadlineProtocol"]

log = logging.getLogger(__name__)


class BodyChunks:
    """The pieces of a request body received and not yet read, as uvicorn's cycle keeps them (`+=`, len, bytes)."""

    __slots__ = ("_chunks", "_size")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0

    def __iadd__(self, chunk: bytes) -> BodyChunks:
        self._chunks.append(chunk)
        self._size += len(chunk)
        return self

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        """The pieces joined: one copy, none when there is one piece."""
        if len(self._chunks) == 1 and type(self._chunks[0]) is bytes:
            return self._chunks[0]
        return b"".join(self._chunks)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its "auto" choice here): a late request header closes the connection.

    It also keeps a request's body pieces unjoined until the app reads them (BodyChunks).
    """

    _header_deadline: asyncio.TimerHandle | None = None
    _deadline_cycle: object = None  # the request cycle that was the latest when the deadline began

    def connection_made(self, transport: Any) -> None:
        """Start the deadline of the first request's header."""
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        """Start the deadline at the first byte of a request that follows a response."""
        if self._between_requests() and (self._header_deadline is None or self._deadline_cycle is not self.cycle):
            self._arm_header_deadline()  # none running, or one begun before the last request (it closes nothing)
        super().data_received(data)

    def on_body(self, body: bytes) -> None:
        """Keep the piece in the cycle's BodyChunks (uvicorn's empty bytearray is replaced after each read)."""
        cycle = self.cycle
        if cycle is not None and type(cycle.body) is bytearray and not cycle.body:
            cycle.body = BodyChunks()  # type: ignore[assignment]  # read as uvicorn reads its bytearray
        super().on_body(body)

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the deadline with the connection."""
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._deadline_cycle = self.cycle
        self._header_deadline = self.loop.call_later(header_timeout_s(), self._header_late, self.cycle)

    def _header_late(self, cycle_then: object) -> None:
        """Close the connection when no request has started since the deadline began (its header is late)."""
        self._header_deadline = None
        if self.cycle is cycle_then and self._between_requests() and not self.transport.is_closing():
            log.info(
                "closed a connection from %s: no whole request header within %.0f s", self.client, header_timeout_s()
            )
            self.transport.close()
