import asyncio
import hashlib
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.orm import Session

from coordinator.api.routes import upload_sessions as update_routes  # where a spooled update is accepted
from coordinator.main import create_app
from coordinator.models import GlobalModel
from coordinator.signals.waiters import TaskSignal
from coordinator.storage import blobs
from coordinator.storage import download_cache as blob_cache
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import (
    ADMIN,
    approve,
    create_study,
    download,
    enrol,
    next_task,
    running_study,
    shifted,
    update_body,
    upload,
)


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    reads: list[tuple[int, int]] = []
    real_read = blobs.read_range

    def counted_read(engine, digest, offset, length):
        reads.append((offset, length))
        return real_read(engine, digest, offset, length)

    monkeypatch.setattr(blobs, "read_range", counted_read)
    monkeypatch.setattr(blob_cache, "read_range", counted_read)
    return reads


def test_every_site_downloads_the_model_from_one_read_of_it(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, headers = running_study(client, sites=("a1", "a2", "a3"))
    reads = _counting_reads(monkeypatch)
    tasks = {site: next_task(client, headers[site]) for site in headers}
    with ThreadPoolExecutor(len(headers)) as pool:
        responses = list(pool.map(lambda s: client.get(tasks[s]["global_model_url"], headers=headers[s]), headers))
    assert {r.status_code for r in responses} == {200} and len({r.content for r in responses}) == 1
    body = responses[0].content
    assert hashlib.sha256(body).hexdigest() == tasks["a1"]["global_model_sha256"]
    assert responses[0].headers["content-length"] == str(len(body))
    assert reads == [(0, len(body))]  # one read, front to back, for all three sites
    etag = responses[0].headers["etag"]
    cached = client.get(tasks["a1"]["global_model_url"], headers={**headers["a1"], "If-None-Match": etag})
    assert cached.status_code == 304 and cached.content == b""


def test_the_round_that_stores_theta_g_hands_it_to_the_cache_and_no_download_reads_it_back(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, headers = running_study(client, sites=("a1", "a2"))
    state = client.app.state.coordinator
    held_at_commit: list[set[str]] = []  # what the cache held as each commit storing a model woke the waiting polls

    def stores_a_model(session: Session, _context: object) -> None:
        if any(isinstance(row, GlobalModel) for row in session.new):
            session.info["stores_a_model"] = True

    def committed(session: Session) -> None:
        if session.info.pop("stores_a_model", False):
            held_at_commit.append(set(state.blob_cache._blobs))

    event.listen(state.sessions, "after_flush", stores_a_model)
    event.listen(state.sessions, "after_commit", committed)
    for site in headers:  # round 1's updates: the round closes and stores theta^g_1
        task = next_task(client, headers[site])
        trained = shifted(download(client, task["global_model_url"], headers[site]), 0.25)
        assert upload(client, task, headers[site], update_body(trained, 10)).status_code == 201
    reads = _counting_reads(monkeypatch)
    tasks = {site: next_task(client, headers[site]) for site in headers}
    assert {task["round"] for task in tasks.values()} == {2}
    digest = tasks["a1"]["global_model_sha256"]
    assert digest in held_at_commit[-1]  # held before the commit that stored it (and opened round 2) woke anyone
    cached = state.blob_cache.get(state.engine, digest, 0)
    assert isinstance(cached, memoryview) and cached.obj is not None  # the round's own body, not a copy joined
    bodies = [client.get(tasks[s]["global_model_url"], headers=headers[s]).content for s in headers]
    assert {hashlib.sha256(body).hexdigest() for body in bodies} == {tasks["a1"]["global_model_sha256"]}
    assert reads == []  # theta^g_1 was held from the moment it was stored


def test_a_model_over_the_cache_budget_is_read_a_chunk_at_a_time(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs, "CHUNK_BYTES", 4096)
    with TestClient(create_app(coordinator_settings_for(database_url, download_cache_bytes=0))) as client:
        _, headers = running_study(client)
        task = next_task(client, headers["lyon"])
        reads = _counting_reads(monkeypatch)
        response = client.get(task["global_model_url"], headers=headers["lyon"])
    assert response.status_code == 200
    assert hashlib.sha256(response.content).hexdigest() == task["global_model_sha256"]
    size = len(response.content)
    assert reads == [(offset, min(4096, size - offset)) for offset in range(0, size, 4096)]


def test_uploads_wait_on_disk_and_at_most_upload_slots_are_checked_at_once(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sites = ("s1", "s2", "s3", "s4")
    seen: list[tuple[type, int]] = []
    busy, most_busy, lock = [0], [0], threading.Lock()
    real_accept = update_routes.accept_update

    def watched_accept(session, **arguments):
        with lock:
            busy[0] += 1
            most_busy[0] = max(most_busy[0], busy[0])
            seen.append((type(arguments["body"].obj), len(arguments["body"])))
        time.sleep(0.05)  # widen the window in which a second upload could overlap
        try:
            return real_accept(session, **arguments)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(update_routes, "accept_update", watched_accept)
    with TestClient(create_app(coordinator_settings_for(database_url, upload_slots=1))) as client:
        _, headers = running_study(client, sites=sites)
        bodies = {}
        for index, site in enumerate(sites):
            task = next_task(client, headers[site])
            bodies[site] = (
                task,
                update_body(shifted(download(client, task["global_model_url"], headers[site]), index), 5),
            )
        with ThreadPoolExecutor(len(sites)) as pool:
            responses = list(pool.map(lambda s: upload(client, bodies[s][0], headers[s], bodies[s][1]), sites))
    assert [r.status_code for r in responses] == [201] * len(sites)
    assert most_busy[0] == 1  # the others waited for the one slot
    assert sorted(seen) == sorted((mmap.mmap, len(bodies[s][1])) for s in sites)  # file mappings, not heap copies


def test_an_oversized_upload_is_refused_while_it_streams_in(database_url: str) -> None:
    with TestClient(create_app(coordinator_settings_for(database_url, max_upload_bytes=4096))) as client:
        _, headers = running_study(client)
        task = next_task(client, headers["lyon"])

        def chunks():
            for _ in range(10):
                yield b"\0" * 1024

        response = client.post(
            task["update_url"],
            content=chunks(),
            headers={**headers["lyon"], "Content-Type": "application/octet-stream"},
        )
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"


def test_a_waiting_long_poll_gets_the_new_round_without_waiting_for_its_poll_interval(database_url: str) -> None:
    settings = coordinator_settings_for(database_url, task_poll_interval_s=60.0, max_poll_wait_s=60.0)
    with TestClient(create_app(settings)) as client:
        headers = enrol(client, "lyon")
        study_id = create_study(client, ["lyon"])
        approve(client, headers, study_id)
        answers = []
        poller = threading.Thread(
            target=lambda: answers.append(client.get("/api/v1/tasks/next?wait=50", headers=headers))
        )
        poller.start()
        time.sleep(0.5)  # the poll has looked once, found nothing, and waits
        started = time.monotonic()
        assert client.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
        poller.join(timeout=60)
        waited = time.monotonic() - started
    assert answers and answers[0].status_code == 200 and answers[0].json()["study_id"] == study_id
    assert waited < 30  # woken by the round that opened, not by its 60-second poll interval


def test_task_signal_wakes_waiters_from_another_thread_and_never_misses_a_change() -> None:
    signal = TaskSignal()

    async def scenario() -> tuple[float, float]:
        seen = signal.version
        signal.notify()  # a change after `seen` was read: waiting returns at once
        start = time.monotonic()
        await signal.wait(seen, 30)
        immediate = time.monotonic() - start
        seen = signal.version
        threading.Timer(0.1, signal.notify).start()
        start = time.monotonic()
        await signal.wait(seen, 30)
        return immediate, time.monotonic() - start

    immediate, woken = asyncio.run(scenario())
    assert immediate < 1 and woken < 10
    assert asyncio.run(_timed_out(signal)) >= 0.05


async def _timed_out(signal: TaskSignal) -> float:
    start = time.monotonic()
    await signal.wait(signal.version, 0.05)
    return time.monotonic() - start


def test_a_cached_model_is_sent_as_views_of_one_copy() -> None:
    from coordinator.api.routes.global_models import _slices
    from coordinator.storage.blobs import CHUNK_BYTES

    data = bytes(range(256)) * (CHUNK_BYTES // 100)

    async def chunks() -> list[memoryview]:
        return [chunk async for chunk in _slices(data)]

    sent = asyncio.run(chunks())
    assert all(isinstance(chunk, memoryview) and chunk.obj is data for chunk in sent)
    assert [len(chunk) for chunk in sent[:-1]] == [CHUNK_BYTES] * (len(sent) - 1)
    assert b"".join(sent) == data
