"""Progress lines of a big download or upload: bytes done of the total, and where a resumed transfer went on from.

A transfer logs a line each PROGRESS_FRACTION of its size or PROGRESS_STEP_BYTES, whichever is more,
at most one every PROGRESS_INTERVAL_S, and one when it ends; one smaller than PROGRESS_MIN_BYTES logs none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = [
    "PROGRESS_FRACTION",
    "PROGRESS_INTERVAL_S",
    "PROGRESS_MIN_BYTES",
    "PROGRESS_STEP_BYTES",
    "TransferProgress",
    "counted",
]

PROGRESS_MIN_BYTES = 4 << 20  # a smaller transfer logs no progress
PROGRESS_STEP_BYTES = 8 << 20  # no more than a line every this many bytes ...
PROGRESS_FRACTION = 0.1  # ... nor every tenth of the transfer
PROGRESS_INTERVAL_S = 1.0  # ... nor more often than this

Piece = TypeVar("Piece", bytes, memoryview)


class TransferProgress:
    """The progress of a transfer (`what`: "download of <url>") of `total` bytes (-1: unknown), logged on `log`."""

    def __init__(self, log: logging.Logger, what: str, total: int, *, clock: Callable[[], float] = time.monotonic):
        self.log, self.what, self.clock = log, what, clock
        self.restart(total)

    def restart(self, total: int, offset: int = 0) -> None:
        """Count a transfer of `total` bytes (-1: unknown) from byte `offset` (not 0: a resumption, logged)."""
        self.total, self.offset = total, offset
        self.quiet = 0 <= total < PROGRESS_MIN_BYTES
        self.step = max(int(total * PROGRESS_FRACTION), PROGRESS_STEP_BYTES)
        self.due = offset + self.step
        self.last = self.clock()
        self.done, self.shown = offset, -1  # shown: the bytes of the last line
        if offset and not self.quiet:
            self.log.info("%s: resumed from byte %d of %s", self.what, offset, self._of())

    def advance(self, done: int) -> None:
        """`done` bytes of the transfer are through: a line when a step is crossed and the last one is old enough."""
        self.done = done
        if self.quiet or done < self.due:
            return
        now = self.clock()
        if now - self.last < PROGRESS_INTERVAL_S:
            return
        self.last, self.due = now, (done // self.step + 1) * self.step
        self._line()

    def finish(self) -> None:
        """The transfer ended well: its last line."""
        if not self.quiet and self.shown != self.done:
            self._line()

    def _of(self) -> str:
        return str(self.total) if self.total >= 0 else "an unknown number of"

    def _line(self) -> None:
        self.shown = self.done
        share = f" ({100 * self.done // self.total}%)" if self.total > 0 else ""
        resumed = f", resumed from byte {self.offset}" if self.offset else ""
        self.log.info("%s: %d of %s bytes%s%s", self.what, self.done, self._of(), share, resumed)


def counted(pieces: Iterable[Piece], progress: TransferProgress, start: int) -> Iterator[Piece]:
    """`pieces`, the progress advanced past each from byte `start` as it is taken."""
    done = start
    for piece in pieces:
        yield piece
        done += len(piece)
        progress.advance(done)
