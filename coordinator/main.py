"""The coordinator app: `create_app(settings)` builds it; its lifespan migrates and runs the deadline ticker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.config
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import Depends, FastAPI
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.engine import make_url

from coordinator.api import dashboard, metrics
from coordinator.api.deps import AppState, authorize
from coordinator.api.errors import install_error_handlers
from coordinator.api.openapi import install_openapi
from coordinator.api.router import api_router
from coordinator.api.routes.upload_sessions import sweep_upload_sessions
from coordinator.config import CoordinatorSettings, blob_dir_for
from coordinator.db import REQUEST_THREADS, fill_pool, make_engine, make_sessionmaker, utc_now
from coordinator.migrate import upgrade_database
from coordinator.rounds.closing import tick
from coordinator.serving.process import (
    configure_server_process,
    freeze_startup_objects,
    on_stop_signal,
    server_log_config,
)
from coordinator.serving.tls import CloseConnections
from coordinator.signals.work import work_version
from coordinator.storage.retention import tidy_store
from coordinator.storage.update_files import FileBlobStore
from coordinator.storage.wal_checkpoints import WalCheckpointer
from shared.release import release_version

__all__ = ["create_app", "create_app_from_env"]

log = logging.getLogger(__name__)


SWEEP_INTERVAL_S = 600.0  # how often the blob store is tidied of what a crash left (coordinator.storage.retention)


async def _tick_forever(state: AppState) -> None:
    """Every tick_interval_s: close rounds that are due, take over abandoned aggregations; now and then, sweep.

    The sweep tidies the blob store and removes abandoned upload sessions (routes/upload_sessions.py).
    """
    settings = state.settings
    next_sweep = time.monotonic()
    while True:
        await asyncio.sleep(settings.tick_interval_s)
        try:
            await run_in_threadpool(tick, state.sessions, now=utc_now(), lease_s=settings.aggregation_lease_s)
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + SWEEP_INTERVAL_S
                await run_in_threadpool(tidy_store, state.sessions)
                await run_in_threadpool(sweep_upload_sessions, state)
        except Exception:  # the ticker must outlive any one failure; the next tick retries
            log.exception("deadline tick failed")


async def _follow_work(state: AppState) -> None:
    """Every task_poll_interval_s while a long-poll waits: read the work version, so other processes' work wakes it."""
    signal = state.tasks_changed
    while not signal.closed:
        await asyncio.sleep(state.settings.task_poll_interval_s)
        if not signal.waiting:
            continue
        try:
            signal.observe(await run_in_threadpool(work_version, state.engine))
        except Exception:  # the follower must outlive a database that does not answer; polls still end on time
            log.exception("reading the work version failed")


def create_app(settings: CoordinatorSettings, *, open_pool_at_start: bool = False) -> FastAPI:
    """The coordinator as an ASGI app; nothing touches the database until it starts.

    `open_pool_at_start`: a served process opens the connections its pool keeps as it starts (fill_pool).
    """
    engine = make_engine(settings.database_url, settings.database_max_connections, checkpoints_elsewhere=True)
    checkpoints = WalCheckpointer(engine) if WalCheckpointer.needed(engine) else None
    blob_dir = blob_dir_for(settings)
    store = FileBlobStore(blob_dir, spare_bytes=settings.blob_spare_bytes) if blob_dir is not None else None
    log.info("uploaded updates are kept in %s", store.root if store is not None else "the database")
    state = AppState(settings=settings, engine=engine, sessions=make_sessionmaker(engine, store), blob_store=store)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The operators' threads come out of the process's 40, so the database pool still covers them all.
        anyio.to_thread.current_default_thread_limiter().total_tokens = REQUEST_THREADS - settings.operator_threads
        if settings.migrate_on_start:
            await run_in_threadpool(upgrade_database, engine)
        if open_pool_at_start:
            await run_in_threadpool(fill_pool, engine)
        freeze_startup_objects()
        if checkpoints is not None:
            checkpoints.start()
        undo_stop_hook = on_stop_signal(state.tasks_changed.close)  # waiting long-polls answer at once
        ticker = asyncio.create_task(_tick_forever(state)) if settings.tick_interval_s > 0 else None
        follower = asyncio.create_task(_follow_work(state))
        try:
            yield
        finally:
            undo_stop_hook()
            for task in (ticker, follower):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if checkpoints is not None:
                await run_in_threadpool(checkpoints.stop)
            engine.dispose()

    app = FastAPI(
        title="cardiofl coordinator",
        summary="Federated studies of ECG classifiers: rounds, updates, global models.",
        version=release_version(),
        lifespan=lifespan,
        dependencies=[Depends(authorize)],  # every route admits the roles that ROUTES names, and no other
    )
    app.state.coordinator = state
    install_error_handlers(app)
    app.include_router(api_router)
    app.include_router(dashboard.router)
    app.include_router(metrics.router)
    install_openapi(app)
    return app


def create_app_from_env() -> FastAPI:
    """The app configured from CARDIOFL_* variables (uvicorn's --factory entry point); logs what is in force."""
    configure_server_process()
    settings = CoordinatorSettings()
    if not logging.getLogger().handlers:  # served by plain uvicorn, not by `cardiofl coordinator serve`
        logging.config.dictConfig(server_log_config(settings.log_format, settings.log_level))
    logging.captureWarnings(settings.log_format == "json")  # in JSON, a warning is one more line of it
    log.info("settings in force: %s", describe_settings(settings))
    return create_app(settings, open_pool_at_start=True)


def create_mutual_tls_app_from_env() -> CloseConnections:
    """The app factory under mutual TLS: the app of `create_app_from_env`, closing every connection."""
    return CloseConnections(create_app_from_env())


def describe_settings(settings: CoordinatorSettings) -> str:
    """Every setting on one line: the database without its password, no secret shown."""
    shown = []
    for name, value in settings.model_dump().items():
        if name == "database_url":
            value = make_url(value).render_as_string(hide_password=True)
        elif name == "admin_token":
            value = "set" if value else "unset"
        shown.append(f"{name}={value}")
    return ", ".join(shown)
