"""A request body handed to the app piece by piece, each piece the bytes object that arrived: never joined.

uvicorn keeps the pieces of a body that arrive between two reads of the app in one growing buffer
(`cycle.body += piece`) and hands the app a copy of it (`bytes(cycle.body)`). A served coordinator
lets 4 MiB wait unread (serving/process.py, widen_receive_buffer), so each byte of an upload was
copied twice more on the event loop, which every site's request shares. `PieceCycle` is uvicorn's
request cycle whose `receive` hands over the oldest waiting piece as it is (`BodyPieces`); the
pieces are the objects the transport produced, so a body reaches the app with no copy on the loop
beyond the one that made it a Python object.
"""

from __future__ import annotations

from collections import deque

from uvicorn._types import ASGIReceiveEvent
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["BodyPieces", "PieceCycle", "declared_length", "read_piece_by_piece"]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class BodyPieces:
    """The pieces of a request body received and not yet read, oldest first; `+=` and len as uvicorn uses them."""

    __slots__ = ("_pieces", "_size")

    def __init__(self) -> None:
        self._pieces: deque[bytes] = deque()
        self._size = 0

    def __iadd__(self, piece: bytes) -> BodyPieces:
        if piece:
            self._pieces.append(piece)
            self._size += len(piece)
        return self

    def __len__(self) -> int:
        return self._size

    def take(self) -> bytes:
        """The oldest piece (b"" when none waits), no longer held."""
        if not self._pieces:
            return b""
        piece = self._pieces.popleft()
        self._size -= len(piece)
        return piece


class PieceCycle(RequestResponseCycle):
    """uvicorn's request cycle whose `receive` hands over one waiting piece of the body at a time."""

    body: BodyPieces  # type: ignore[assignment]

    async def receive(self) -> ASGIReceiveEvent:
        """The next piece of the body (waiting for one when none is held), or http.disconnect as uvicorn says it."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete and not len(self.body):
            self.flow.resume_reading()
            await self.message_event.wait()
        self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        piece = self.body.take()
        if len(self.body) <= httptools_impl.HIGH_WATER_LIMIT:  # type: ignore[attr-defined]  # widened when served
            self.flow.resume_reading()
        return {"type": "http.request", "body": piece, "more_body": self.more_body or bool(len(self.body))}


def read_piece_by_piece(cycle: RequestResponseCycle) -> PieceCycle:
    """Make the cycle uvicorn just built a PieceCycle holding its body in BodyPieces (before any piece arrives)."""
    if len(cycle.body):
        raise RuntimeError("a request cycle can read piece by piece only before its body arrives")
    cycle.__class__ = PieceCycle
    assert isinstance(cycle, PieceCycle)
    cycle.body = BodyPieces()
    return cycle


def declared_length(headers: list[tuple[bytes, bytes]]) -> int:
    """A request body's length from its one Content-Length header (names lower case); 0 if none, several or chunked."""
    lengths = [value for name, value in headers if name == b"content-length"]
    if len(lengths) != 1 or not lengths[0].isdigit() or any(name == b"transfer-encoding" for name, _ in headers):
        return 0
    return int(lengths[0])
