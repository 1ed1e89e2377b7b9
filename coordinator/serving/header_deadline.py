"""uvicorn's HTTP protocol with a deadline on each request's header, and request bodies that skip the parser.

A client that sends a header a byte at a time, or never, is disconnected.
uvicorn times out only an idle keep-alive connection after a response (`timeout_keep_alive`); a
connection that has not yet sent a whole request header is held for as long as the client likes
(neither h11 nor httptools times a header out). Each such
connection costs a file descriptor and nothing else (the event loop serves others meanwhile), but
enough of them exhaust the process's descriptors. `HeaderDeadlineProtocol` is uvicorn's HTTP
protocol that closes a connection whose request header is not complete within the deadline of the
connection's opening, or of the first byte of its next request: CARDIOFL_HEADER_TIMEOUT_S (set by
`cardiofl coordinator serve --header-timeout`), 30 s unless set (coordinator.serving.limits).

Past its header, a body of a declared length does not go through the HTTP parser either: the
parser would copy each piece it finds into a new bytes object; the protocol counts the bytes off
instead and hands on the pieces the transport made (serving/body_pieces.py reads them to the app
one at a time). Bodies sent chunked (`Transfer-Encoding`) are parsed as uvicorn parses them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.serving.body_pieces import declared_length, read_piece_by_piece
from coordinator.serving.limits import header_timeout_s

__all__ = ["HeaderDeadlineProtocol"]

log = logging.getLogger(__name__)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its "auto" choice here): a late request header closes the connection.

    A body of declared length is counted off past the parser, and read to the app a piece at a time.
    """

    _header_deadline: asyncio.TimerHandle | None = None
    _deadline_cycle: object = None  # the request cycle that was the latest when the deadline began
    _body_to_come = 0  # of the latest request's declared body, the bytes not yet handed to its cycle
    _past_parser = False  # whether those bytes are counted off here instead of fed to the parser

    def connection_made(self, transport: Any) -> None:
        """Start the deadline of the first request's header."""
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        """Count off body bytes; start the deadline at the first byte of a request that follows a response."""
        if self._past_parser:
            data = self._count_off_body(data)
            if not data:
                return
        if self._between_requests() and (self._header_deadline is None or self._deadline_cycle is not self.cycle):
            self._arm_header_deadline()  # none running, or one begun before the last request (it closes nothing)
        super().data_received(data)
        self._past_parser = self._body_to_come > 0 and not self.transport.is_closing()  # the rest skips the parser

    def on_headers_complete(self) -> None:
        """Have the new request cycle read its body piece by piece; note the body's declared length."""
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is previous or self.cycle is None:  # an upgrade: no request cycle of its own
            return
        read_piece_by_piece(self.cycle)
        self._body_to_come = declared_length(self.headers)

    def on_body(self, body: bytes) -> None:
        """Count the piece, and hand it to the cycle as uvicorn does (flow control included)."""
        self._body_to_come -= len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        """The body is whole."""
        self._body_to_come, self._past_parser = 0, False
        super().on_message_complete()

    def _count_off_body(self, data: bytes) -> bytes:
        """Hand the body's bytes in `data` to the cycle as they are; what follows the body (the next request)."""
        self._unset_keepalive_if_required()
        left = self._body_to_come
        piece, rest = (data, b"") if len(data) <= left else (data[:left], data[left:])
        self.on_body(piece)
        if not self._body_to_come:
            self.parser = httptools.HttpRequestParser(self)  # the old one still waits for the body it was not given
            self.on_message_complete()
        return rest

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
