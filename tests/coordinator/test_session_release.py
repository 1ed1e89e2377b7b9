"""A sync route gives its database connection back as its function returns, not after FastAPI's next thread hop.

FastAPI validates a sync route's return value in a second trip to the request threads while the
route's session is still open. When requests outnumbered the threads, the routes that had returned
waited for a thread while holding their connections and the routes holding the threads waited for a
connection, until the pool's 30 s timeout answered 500 (bench/scale.py at K = 128 on SQLite: up to 20
of 128 sites' first `GET /sites/me/studies`). Here two request threads and two connections make any
such wait a deadlock.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import BaseRoute

from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.main import create_app
from tests.conftest import coordinator_settings_for, create_tables
from tests.coordinator.factories import enrol

ROUTES_OF_SITES = ["/api/v1/sites/me/studies", "/api/v1/sites/me", "/api/v1/jobs"]


async def _default_threads() -> anyio.CapacityLimiter:
    return anyio.to_thread.current_default_thread_limiter()


def _api_routes(routes: Sequence[BaseRoute]) -> Iterator[APIRoute]:
    """The API routes of `routes`, those of included routers too."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)  # FastAPI keeps an included router whole
        if included is not None:
            yield from _api_routes(included.routes)


def test_every_sync_route_closes_its_sessions_as_it_returns(tmp_path: Path) -> None:
    app = create_app(coordinator_settings_for(f"sqlite:///{tmp_path / 'c.db'}"))
    routes = list(_api_routes(app.routes))
    assert [route.path for route in routes if not isinstance(route, SessionReleasingRoute)] == []
    plain = [route for route in routes if not inspect.iscoroutinefunction(route.endpoint)]
    assert len(plain) > 20 and all(inspect.unwrap(route.endpoint) is not route.endpoint for route in plain)


def test_requests_queued_on_two_threads_and_two_connections_all_answer(tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'c.db'}"
    create_tables(database_url)
    settings = coordinator_settings_for(database_url, database_max_connections=2, blob_dir=str(tmp_path / "blobs"))
    with TestClient(create_app(settings)) as client:
        sites = [enrol(client, f"site-{index}") for index in range(3)]
        limiter = client.portal.call(_default_threads)
        client.portal.call(setattr, limiter, "total_tokens", 2)
        holders = [object(), object()]
        for holder in holders:  # both threads taken: the requests below queue, in this order
            client.portal.call(limiter.acquire_on_behalf_of, holder)
        answered: list[tuple[str, int]] = []

        def ask(path: str, headers: dict[str, str]) -> None:
            answered.append((path, client.get(path, headers=headers).status_code))

        callers = [threading.Thread(target=ask, args=(path, headers)) for headers in sites for path in ROUTES_OF_SITES]
        for waiting, caller in enumerate(callers, start=1):
            caller.start()
            give_up = time.monotonic() + 10
            while client.portal.call(limiter.statistics).tasks_waiting < waiting:
                assert time.monotonic() < give_up, f"request {waiting} never queued for a thread"
                time.sleep(0.01)
        for holder in holders:
            client.portal.call(limiter.release_on_behalf_of, holder)
        for caller in callers:
            caller.join(timeout=20)  # a deadlock holds them 30 s (the pool's timeout), then answers 500
        assert sorted(answered) == sorted((path, 200) for _ in sites for path in ROUTES_OF_SITES)
