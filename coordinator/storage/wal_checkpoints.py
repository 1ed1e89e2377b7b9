"""SQLite's write-ahead log copied back into the database by a thread of the serving process, not by a commit.

By default the commit that takes SQLite's log past 1,000 pages copies the log into the database and
syncs it before it returns. The commit that stores theta^g_t is such a commit, and it is the last
step before the sites learn of the next round: every site would wait for that copy. A served
coordinator's engine turns those commits' copies off (coordinator.db.make_engine
`checkpoints_elsewhere`) and runs a WalCheckpointer instead, which checkpoints every `interval_s`
(PASSIVE: it waits for no reader and blocks no writer), and once more as it stops. The log is reset
to its start (and cut back to coordinator.db.WAL_SIZE_LIMIT_BYTES) by the first write after a
complete checkpoint, as before.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from sqlalchemy import Engine

from coordinator.db import in_memory

__all__ = ["Checkpoint", "WalCheckpointer", "checkpoint"]

log = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the thread copies the log back; a round's commit is copied within this


@dataclass(frozen=True)
class Checkpoint:
    """What one checkpoint found: whether another one was running, the log's frames, those now in the database."""

    busy: bool
    log_frames: int
    checkpointed_frames: int


def checkpoint(engine: Engine) -> Checkpoint:
    """One PASSIVE checkpoint of `engine`'s SQLite database, on a pooled connection outside any transaction."""
    connection = engine.raw_connection()
    try:
        cursor = connection.cursor()
        busy, log_frames, done = cursor.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        cursor.close()
    finally:
        connection.close()
    return Checkpoint(bool(busy), log_frames, done)


class WalCheckpointer:
    """A daemon thread checkpointing a SQLite file database every `interval_s`, and once more at `stop()`."""

    def __init__(self, engine: Engine, interval_s: float = INTERVAL_S) -> None:
        self.engine, self.interval_s = engine, interval_s
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def needed(engine: Engine) -> bool:
        """Whether `engine` is a SQLite file database, which has a write-ahead log to copy back."""
        return engine.dialect.name == "sqlite" and not in_memory(str(engine.url))

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._run, name="wal-checkpoints", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after one last checkpoint, so that a stopping server leaves the log copied back."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                checkpoint(self.engine)
            except Exception:  # the next interval tries again; the log grows meanwhile, nothing is lost
                log.warning("a checkpoint of the write-ahead log failed", exc_info=True)
            if self._stopped.is_set():
                return
