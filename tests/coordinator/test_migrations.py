import re
import sqlite3
import threading
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import Engine, inspect, text

from coordinator.db import Base, make_engine, utc_now
from coordinator.main import create_app
from coordinator.migrate import alembic_config, upgrade_database
from coordinator.models import BlobLocation
from coordinator.storage.blobs import open_blobs, sha256_of
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, running_study


def test_upgrade_head_on_an_empty_database_equals_the_models(empty_database_url: str) -> None:
    engine = make_engine(empty_database_url)
    upgrade_database(engine)
    upgrade_database(engine)  # a second run is a no-op
    with engine.connect() as connection:
        differences = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
        )
        tables = set(inspect(connection).get_table_names())
    engine.dispose()
    assert differences == []
    assert tables == set(Base.metadata.tables) | {"alembic_version"}


def test_downgrade_to_base_removes_every_table(empty_database_url: str) -> None:
    engine = make_engine(empty_database_url)
    upgrade_database(engine)
    with engine.begin() as connection:
        command.downgrade(alembic_config(connection), "base")
    with engine.connect() as connection:
        assert set(inspect(connection).get_table_names()) <= {"alembic_version"}
    engine.dispose()


def test_workers_migrating_at_once_wait_for_each_other(empty_database_url: str) -> None:
    engines = [make_engine(empty_database_url) for _ in range(3)]
    errors: list[BaseException] = []

    def migrate(engine) -> None:
        try:
            upgrade_database(engine)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=migrate, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for engine in engines:
        engine.dispose()
    assert errors == []


def test_a_worker_opening_a_new_sqlite_file_another_holds_waits_instead_of_failing(tmp_path: Path) -> None:
    """Switching a new file to WAL gets "database is locked" at once, busy timeout or not: the engine waits."""
    path = tmp_path / "coordinator.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE other_worker (id INTEGER)")  # the file exists, still in rollback-journal mode
    holder.execute("BEGIN IMMEDIATE")  # another worker, writing it in its first transaction
    holder.execute("INSERT INTO other_worker VALUES (1)")
    engine = make_engine(f"sqlite:///{path}")
    modes: list[str] = []
    opened = threading.Thread(target=lambda: modes.append(_journal_mode(engine)))
    opened.start()
    opened.join(timeout=0.5)
    assert opened.is_alive() and not modes  # waiting for the file, not failed
    holder.execute("COMMIT")
    holder.close()
    opened.join(timeout=30)
    engine.dispose()
    assert modes == ["wal"]


def _journal_mode(engine: Engine) -> str:
    with engine.connect() as connection:
        return str(connection.exec_driver_sql("PRAGMA journal_mode").scalar())


def test_app_migrates_on_start(empty_database_url: str) -> None:
    settings = coordinator_settings_for(empty_database_url, migrate_on_start=True)
    with TestClient(create_app(settings)) as client:
        study_id, _ = running_study(client)
        assert client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).status_code == 200


def test_blobs_stored_before_the_blob_store_stay_readable_after_the_upgrade(empty_database_url: str) -> None:
    engine = make_engine(empty_database_url)
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0002")
        data = bytes(range(256)) * 300
        connection.execute(
            text("INSERT INTO blobs (sha256, size, data, created_at) VALUES (:sha, :size, :data, :at)"),
            {"sha": sha256_of(data), "size": len(data), "data": data, "at": utc_now()},
        )
    upgrade_database(engine)
    with engine.connect() as connection:
        location = connection.execute(text("SELECT location FROM blobs")).scalar()
    assert location == BlobLocation.DATABASE
    with open_blobs(engine, [sha256_of(data)], prefetch=0) as (blob,):
        assert bytes(blob.read(1000, 300)) == data[1000:1300]
    engine.dispose()


def test_studies_made_before_uids_get_distinct_ones_on_upgrade(empty_database_url: str) -> None:
    engine = make_engine(empty_database_url)
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0004")
        for name in ("a", "b"):
            connection.execute(
                text(
                    "INSERT INTO studies (name, config, status, created_by, created_at, updated_at)"
                    " VALUES (:name, '{}', 'draft', 'test', :at, :at)"
                ),
                {"name": name, "at": utc_now()},
            )
    upgrade_database(engine)
    with engine.connect() as connection:
        uids = list(connection.execute(text("SELECT uid FROM studies")).scalars())
    engine.dispose()
    assert len(set(uids)) == 2 and all(re.fullmatch("[0-9a-f]{32}", uid) for uid in uids)


def test_blobs_in_the_database_move_into_parts_and_back(empty_database_url: str) -> None:
    engine = make_engine(empty_database_url)
    big = bytes(range(256)) * ((64 << 20) // 256) + b"tail"  # 64 MiB and 4 bytes: two parts
    small, stored = b"small model", b"an update kept in the blob store"
    rows = [(big, "database"), (small, "database"), (stored, "store")]
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0011")
        for data, location in rows:
            connection.execute(
                text(
                    "INSERT INTO blobs (sha256, size, data, location, created_at)"
                    " VALUES (:sha, :size, :data, :location, :at)"
                ),
                {
                    "sha": sha256_of(data),
                    "size": len(data),
                    "data": data if location == "database" else b"",
                    "location": location,
                    "at": utc_now(),
                },
            )
    upgrade_database(engine)
    with engine.connect() as connection:
        parts = connection.execute(text("SELECT sha256, seq, length(data) FROM blob_parts ORDER BY sha256, seq")).all()
        columns = {column["name"] for column in inspect(connection).get_columns("blobs")}
    assert "data" not in columns
    assert sorted(parts) == sorted(
        [(sha256_of(big), 0, 64 << 20), (sha256_of(big), 1, 4), (sha256_of(small), 0, len(small))]
    )
    with open_blobs(engine, [sha256_of(big), sha256_of(small)], prefetch=0) as (first, second):
        assert bytes(first.read((64 << 20) - 2, 6)) == big[-6:] and bytes(second.read(0, 100)) == small
    with engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0011")
    with engine.connect() as connection:
        kept = dict(connection.execute(text("SELECT sha256, data FROM blobs")).all())
    engine.dispose()
    assert {digest: bytes(data) for digest, data in kept.items()} == {
        sha256_of(big): big,
        sha256_of(small): small,
        sha256_of(stored): b"",
    }


def test_every_sqlite_connection_keeps_a_small_page_cache(tmp_path: Path) -> None:
    from coordinator.db import SQLITE_CACHE_KIB

    engine = make_engine(f"sqlite:///{tmp_path / 'cache.db'}")
    connections = [engine.raw_connection() for _ in range(3)]  # each pooled connection has a page cache of its own
    try:
        sizes = [connection.cursor().execute("PRAGMA cache_size").fetchone()[0] for connection in connections]
    finally:
        for connection in connections:
            connection.close()
        engine.dispose()
    assert sizes == [-SQLITE_CACHE_KIB] * 3 and SQLITE_CACHE_KIB <= 1024  # KiB, against SQLite's default 2000


def test_a_served_process_opens_the_connections_its_pool_keeps_as_it_starts(tmp_path: Path) -> None:
    from coordinator.db import POOL_KEPT, fill_pool

    settings = coordinator_settings_for(f"sqlite:///{tmp_path / 'pool.db'}", tick_interval_s=0)
    for served, kept in ((True, POOL_KEPT), (False, 0)):
        app = create_app(settings, open_pool_at_start=served)
        with TestClient(app):
            assert app.state.coordinator.engine.pool.checkedin() >= kept  # idle in the pool, open
            if not served:
                assert app.state.coordinator.engine.pool.checkedin() <= 2  # migrations' and the like only
    memory = make_engine("sqlite://")
    assert fill_pool(memory) == 0  # one connection is the whole of a memory database
    memory.dispose()
