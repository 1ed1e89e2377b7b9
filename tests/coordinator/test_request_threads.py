"""Operators' requests have request threads of their own: a wave of sites' requests cannot queue them."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
from fastapi.testclient import TestClient
from httpx import Response

from coordinator.db import REQUEST_THREADS
from tests.coordinator.factories import ADMIN, enrol


async def _default_threads() -> anyio.CapacityLimiter:
    return anyio.to_thread.current_default_thread_limiter()


def _status_within(seconds: float, call: Callable[[], Response]) -> int | None:
    """The status code of `call()` if it answers within `seconds`, else None (it may answer later)."""
    answered: list[int] = []
    caller = threading.Thread(target=lambda: answered.append(call().status_code), daemon=True)
    caller.start()
    caller.join(timeout=seconds)
    return answered[0] if answered else None


def test_status_and_health_answer_while_every_thread_of_the_sites_is_taken(client: TestClient) -> None:
    site = enrol(client, "site-a")
    limiter = client.portal.call(_default_threads)
    assert limiter.total_tokens == REQUEST_THREADS - client.app.state.coordinator.settings.operator_threads
    holders = [object() for _ in range(int(limiter.total_tokens))]
    for holder in holders:  # as K woken polls would: every default request thread busy
        client.portal.call(limiter.acquire_on_behalf_of, holder)
    answered: list[int] = []
    poll = threading.Thread(target=lambda: answered.append(client.get("/api/v1/sites/me", headers=site).status_code))
    try:
        poll.start()
        assert _status_within(10, lambda: client.get("/api/v1/status", headers=ADMIN)) == 200
        assert _status_within(10, lambda: client.get("/api/v1/health")) == 200
        poll.join(timeout=0.5)
        assert poll.is_alive() and not answered  # the site's request waits for one of the threads taken
    finally:
        for holder in holders:
            client.portal.call(limiter.release_on_behalf_of, holder)
    poll.join(timeout=30)
    assert answered == [200]
