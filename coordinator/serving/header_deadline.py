"""A deadline on each request's header: a client that sends it a byte at a time, or never, is disconnected.

uvicorn times out only an idle keep-alive connection after a response (`timeout_keep_alive`); a
connection that has not yet sent a whole request header is held for as long as the client likes
(neither h11 nor httptools times a header out). Each such
connection costs a file descriptor and nothing else (the event loop serves others meanwhile), but
enough of them exhaust the process's descriptors. `HeaderDeadlineProtocol` is uvicorn's HTTP
protocol that closes a connection whose request header is not complete within the deadline of the
connection's opening, or of the first byte of its next request: CARDIOFL_HEADER_TIMEOUT_S (set by
`cardiofl coordinator serve --header-timeout`), 30 s unless set (coordinator.serving.limits).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.serving.limits import header_timeout_s

__all__ = ["HeaderDeadlineProtocol"]

log = logging.getLogger(__name__)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its "auto" choice here) that closes a connection whose request header is late."""

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
