"""Database plumbing: the declarative base, UTC time and study-terms types, engines alike on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import sqlite3
import time
import weakref
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import JSON, DateTime, Engine, create_engine, event, make_url
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import QueuePool
from sqlalchemy.types import TypeDecorator

from shared.terms import StudyTerms

__all__ = [
    "BLOB_STORE",
    "DOWNLOAD_CACHE",
    "Base",
    "TermsColumn",
    "UTCDateTime",
    "in_memory",
    "make_engine",
    "make_sessionmaker",
    "reading",
    "utc_now",
]


def utc_now() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back timezone-aware (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Store UTC; naive datetimes are a programming error."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use utc_now()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Read back timezone-aware UTC."""
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class TermsColumn(TypeDecorator[StudyTerms]):
    """A study's StudyTerms stored as their JSON and read back typed, each distinct JSON parsed once."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: StudyTerms | None, dialect: Dialect) -> dict[str, Any] | None:
        """Store the terms' JSON; anything but StudyTerms is a programming error."""
        if value is None:
            return None
        if not isinstance(value, StudyTerms):
            raise TypeError(f"a study's terms are StudyTerms, not {type(value).__name__}")
        return value.model_dump(mode="json")

    def process_result_value(self, value: dict[str, Any] | None, dialect: Dialect) -> StudyTerms | None:
        """The stored JSON, validated (once per distinct JSON: a study's terms never change)."""
        return None if value is None else _parsed_terms(json.dumps(value, sort_keys=True))


@lru_cache(maxsize=256)
def _parsed_terms(canonical: str) -> StudyTerms:
    return StudyTerms.model_validate_json(canonical)


class Base(DeclarativeBase):
    """Base of every coordinator table."""


READ_ONLY_OPTION = "cardiofl_read_only"
WAL_SIZE_LIMIT_BYTES = 32 << 20
SQLITE_BUSY_TIMEOUT_S = 60.0  # how long a SQLite writer queues for the lock before "database is locked"
# Each pooled connection keeps its own page cache (SQLite's default 2 MB): the pool opening a connection late
# grew the RSS by a step the soak saw as a slope. 512 KiB (8 pages of 64 kB) costs no round CPU
# (bench/round_overhead.py K = 4: 1.92 s of coordinator CPU per round against 1.98 with 2 MB).
SQLITE_CACHE_KIB = 512
# The threads that run a process's requests (anyio's default, split by create_app between sites and
# operators); a process's connections at most (CARDIOFL_DATABASE_MAX_CONNECTIONS), of which POOL_KEPT
# stay open: more than those threads, so no request waits on the pool while another holds a
# connection (on SQLite, possibly the write lock) and waits for a pool slot itself.
REQUEST_THREADS = 40
MAX_CONNECTIONS = 45
POOL_KEPT = 10
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


def strict_json(value: Any) -> str:
    """JSON for a JSON column; NaN and Infinity, which JSON lacks (and PostgreSQL refuses), raise ValueError."""
    return json.dumps(value, allow_nan=False)


def make_engine(
    url: str, max_connections: int = MAX_CONNECTIONS, *, checkpoints_elsewhere: bool = False, **kwargs: Any
) -> Engine:
    """An engine for `url` of at most `max_connections`; on SQLite a writer takes the write lock up front.

    SQLite's default deferred transactions fail with "database is locked" when a transaction
    that read first tries to write after another writer; taking the lock at BEGIN serialises
    writers cleanly instead, and a busy timeout lets them queue. `checkpoints_elsewhere`: no commit
    copies SQLite's write-ahead log back into the database; a WalCheckpointer thread does
    (coordinator.storage.wal_checkpoints), so a commit of a large model returns before that copy.
    """
    kwargs.setdefault("json_serializer", strict_json)
    if "poolclass" not in kwargs and not in_memory(url):  # one connection is the whole of a memory database
        kwargs.setdefault("pool_size", min(POOL_KEPT, max_connections))
        kwargs.setdefault("max_overflow", max_connections - kwargs["pool_size"])
    if url.startswith("postgresql+psycopg"):
        engine = create_engine(url, pool_pre_ping=True, **kwargs)
        event.listen(engine, "connect", _send_bytes_in_binary)
    elif not url.startswith("sqlite"):
        engine = create_engine(url, pool_pre_ping=True, **kwargs)
    else:
        engine = _sqlite_engine(url, checkpoints_elsewhere=checkpoints_elsewhere, **kwargs)
    event.listen(engine, "before_cursor_execute", _refuse_writes_when_reading)
    return engine


def fill_pool(engine: Engine) -> int:
    """On SQLite, open the connections the pool keeps (POOL_KEPT) now, at start; how many were opened.

    The pool otherwise opens them as bursts of requests first need them, which may be weeks into a
    run: each SQLite connection then adds its caches (its page cache and prepared statements, about
    1 MB) to the process as a step up. Opened at start, they are part of the memory a run begins
    with. On PostgreSQL a connection is a server process of its own: those open only when needed.
    """
    if engine.dialect.name != "sqlite" or not isinstance(engine.pool, QueuePool):
        return 0
    opened = [engine.connect() for _ in range(engine.pool.size())]
    for connection in opened:
        connection.close()  # back to the pool, open
    return len(opened)


def in_memory(url: str) -> bool:
    """Whether `url` names an in-memory SQLite database."""
    parsed = make_url(url)
    memory = parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"
    return parsed.get_backend_name() == "sqlite" and memory


def _refuse_writes_when_reading(connection: Any, _cursor: Any, statement: str, *_args: Any) -> None:
    """A write in a transaction of `reading(engine)` is a programming error: say so (on SQLite it could deadlock)."""
    if connection.get_execution_options().get(READ_ONLY_OPTION) and statement.lstrip()[:7].upper().startswith(_WRITES):
        raise RuntimeError(f"a write in a read-only transaction: {statement[:80]!r}; write in a session of the engine")


def _sqlite_engine(url: str, *, checkpoints_elsewhere: bool = False, **kwargs: Any) -> Engine:
    """A SQLite engine: foreign keys, busy timeout, WAL, large pages, and BEGIN IMMEDIATE for writers."""
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S}, **kwargs)

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy, not the driver, emits BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute(f"PRAGMA cache_size = -{SQLITE_CACHE_KIB}")
        if cursor.execute("PRAGMA page_count").fetchone()[0] == 0:  # settings that only a new file takes
            # Large pages for a database of multi-megabyte blobs: a blob is read and written in 16x
            # fewer page steps (3-4x faster).
            cursor.execute("PRAGMA page_size = 65536")
            # Pointer-map pages let a blob handle find the page at any offset of a blob without
            # reading the pages before it, so threads can read a blob's halves at once (see
            # stored_updates); freed pages can also be returned with `PRAGMA incremental_vacuum`.
            # (Set on an existing file, it would wait for the write lock.)
            cursor.execute("PRAGMA auto_vacuum = INCREMENTAL")
        if ":memory:" not in url:
            _use_wal(cursor)
            # After a checkpoint the write-ahead log is cut back to this size instead of keeping the
            # largest it ever grew to (a model per round passes through it).
            cursor.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
            if checkpoints_elsewhere:  # else the commit that takes the log past 1,000 pages copies it back itself
                cursor.execute("PRAGMA wal_autocheckpoint = 0")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        read_only = connection.get_execution_options().get(READ_ONLY_OPTION, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _use_wal(cursor: Any, wait_s: float = SQLITE_BUSY_TIMEOUT_S) -> None:
    """Put the file in WAL mode, waiting for other connections as the busy timeout would.

    Switching a new file to WAL needs it to itself, and SQLite answers "database is locked" at once,
    without its busy handler, while another connection (a worker starting beside this one) holds it.
    """
    give_up = time.monotonic() + wait_s
    while cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > give_up:
                raise
            time.sleep(0.02)


def _send_bytes_in_binary(dbapi_connection: Any, _record: Any) -> None:
    """Send blobs to PostgreSQL in binary rather than hex text: several times faster for large models."""
    from psycopg.types.string import BytesBinaryDumper

    for kind in (bytes, bytearray, memoryview):
        dbapi_connection.adapters.register_dumper(kind, BytesBinaryDumper)


def reading(engine: Engine) -> Engine:
    """`engine` for transactions that only read: on SQLite they begin deferred and take no write lock.

    A write in such a transaction may fail at once with "database is locked" when another writer
    holds the lock; write in a session of `engine` itself instead. Made once per engine (making one
    runs the engine's option events: a cost per request, were it made per request).
    """
    found = _READING.get(engine)
    if found is None:
        found = _READING[engine] = engine.execution_options(**{READ_ONLY_OPTION: True})
    return found


_READING: weakref.WeakKeyDictionary[Engine, Engine] = weakref.WeakKeyDictionary()


BLOB_STORE = "blob_store"  # Session.info key: the coordinator's blob store, or None
DOWNLOAD_CACHE = "download_cache"  # Session.info key: this process's cache of models being downloaded, if any


def make_sessionmaker(engine: Engine, blob_store: object | None = None) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit, and know the coordinator's blob store (storage.blobs).

    The store is typed `object` here: the storage room stands on this module, which names none of it.
    """
    return sessionmaker(engine, expire_on_commit=False, info={BLOB_STORE: blob_store})
