"""A served coordinator's commits leave SQLite's write-ahead log to a checkpoint thread (storage/wal_checkpoints.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import Engine

from coordinator.config import CoordinatorSettings
from coordinator.db import make_engine, make_sessionmaker
from coordinator.main import create_app
from coordinator.storage.blobs import put_blob, read_blob
from coordinator.storage.wal_checkpoints import WalCheckpointer, checkpoint
from tests.conftest import ADMIN_TOKEN, create_tables

MODEL = bytes(range(256)) * (12 << 12)  # 12 MiB: past 1,000 pages of 64 kB only with the next ones


def _engine(tmp_path: Path, *, elsewhere: bool) -> Engine:
    tmp_path.mkdir(exist_ok=True)
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    create_tables(url)
    return make_engine(url, checkpoints_elsewhere=elsewhere)


def _store(engine: Engine, payloads: list[bytes]) -> list[str]:
    with make_sessionmaker(engine)() as session:
        digests = [put_blob(session, payload) for payload in payloads]
        session.commit()
    return digests


def test_a_commit_copies_the_log_back_only_without_a_checkpoint_thread(tmp_path: Path) -> None:
    payloads = [bytes([k]) * (70 << 20) for k in range(1)]  # 70 MB: 1,100 pages through the log in one commit
    own = _engine(tmp_path / "own", elsewhere=False)
    _store(own, payloads)
    copied = checkpoint(own)
    assert copied.log_frames > 1000 and copied.checkpointed_frames == copied.log_frames
    assert checkpoint(own) == copied  # nothing was left for this checkpoint: the commit had copied it
    left = _engine(tmp_path / "left", elsewhere=True)
    _store(left, payloads)
    assert (tmp_path / "left" / "coordinator.db").stat().st_size < 8 << 20  # the schema's pages: the model is logged
    done = checkpoint(left)
    assert not done.busy and done.checkpointed_frames == done.log_frames > 1000
    assert (tmp_path / "left" / "coordinator.db").stat().st_size > 70 << 20
    own.dispose()
    left.dispose()


def test_the_thread_copies_the_log_back_soon_after_a_commit_and_once_more_when_stopped(tmp_path: Path) -> None:
    engine = _engine(tmp_path, elsewhere=True)
    database = tmp_path / "coordinator.db"
    thread = WalCheckpointer(engine, interval_s=0.05)
    thread.start()
    try:
        (digest,) = _store(engine, [MODEL])
        give_up = time.monotonic() + 10
        while database.stat().st_size < len(MODEL):
            assert time.monotonic() < give_up, "the log was not copied back"
            time.sleep(0.02)
    finally:
        thread.stop()
    assert not any(t.name == "wal-checkpoints" and t.is_alive() for t in threading.enumerate())
    slow = WalCheckpointer(engine, interval_s=3600)  # only the last checkpoint, at stop, can copy this one
    slow.start()
    _store(engine, [MODEL[::-1]])
    size = database.stat().st_size
    slow.stop()
    assert database.stat().st_size >= size + len(MODEL) - (1 << 20)
    with make_sessionmaker(engine)() as session:
        assert read_blob(session, digest) == MODEL
    engine.dispose()


def test_a_served_coordinator_runs_the_thread_on_sqlite_files_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    settings = CoordinatorSettings(database_url=url, admin_token=ADMIN_TOKEN, tick_interval_s=0)
    app = create_app(settings)
    with TestClient(app):
        assert any(t.name == "wal-checkpoints" for t in threading.enumerate())
        raw = app.state.coordinator.engine.raw_connection()
        try:  # no commit of this engine copies the log back: the thread does
            assert raw.cursor().execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        finally:
            raw.close()
    assert not any(t.name == "wal-checkpoints" for t in threading.enumerate())
    assert not WalCheckpointer.needed(make_engine("sqlite://"))
