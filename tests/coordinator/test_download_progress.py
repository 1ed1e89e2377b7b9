"""A site's model download under way shows on the status as bytes sent of the model's size, until it ends."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from coordinator.api.routes import global_models
from coordinator.config import CoordinatorSettings
from coordinator.main import create_app
from coordinator.storage import download_progress
from coordinator.storage.blobs import CHUNK_BYTES
from coordinator.storage.download_progress import STALE_S, DownloadKey, DownloadsUnderWay
from tests.coordinator.factories import issue, next_task, running_study
from tests.support.live_server import served

KEY = DownloadKey(study_id=3, model_round=4, site_id=7, size=50)


@pytest.fixture()
def every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker follows every chunk (not at most every half second)."""
    monkeypatch.setattr(download_progress, "UPDATE_EVERY_S", 0.0)


def _drive(stream: AsyncIterator[bytes], look: Callable[[], Any], chunks: int) -> list[Any]:
    """What `look()` sees after each of the first `chunks` chunks is taken from `stream`, then after it is closed."""

    async def take() -> list[Any]:
        seen = []
        for _ in range(chunks):
            await anext(stream)
            seen.append(look())
        await stream.aclose()  # the response ends, sent whole or cut
        seen.append(look())
        return seen

    return anyio.run(take)


@pytest.mark.usefixtures("every_chunk")
def test_the_marker_follows_the_bytes_sent_and_goes_when_the_download_ends(tmp_path: Path) -> None:
    downloads = DownloadsUnderWay(tmp_path)
    stream = downloads.tracked([b"x" * 10] * 5, KEY)  # a sync iterable is read in a request thread
    seen = _drive(stream, downloads.held, 5)
    # a chunk counts once it has gone: its send returned and the next one is asked for
    assert seen[:5] == [{(3, 7): (10 * sent, 50)} for sent in range(5)]
    assert seen[5] == {} and list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("every_chunk")
def test_a_resumed_download_counts_the_bytes_before_its_range_and_a_cut_one_goes(tmp_path: Path) -> None:
    downloads = DownloadsUnderWay(tmp_path)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"y" * 10

    seen = _drive(downloads.tracked(chunks(), KEY, start=20), downloads.held, 2)
    assert seen == [{(3, 7): (20, 50)}, {(3, 7): (30, 50)}, {}]  # cut after two of its three chunks
    assert list(tmp_path.iterdir()) == []


def test_the_marker_moves_at_most_every_update_interval(tmp_path: Path) -> None:
    downloads = DownloadsUnderWay(tmp_path)  # UPDATE_EVERY_S = 0.5: 5 chunks taken at once move it not at all
    seen = _drive(downloads.tracked([b"z" * 10] * 6, KEY), downloads.held, 6)
    assert seen[:6] == [{(3, 7): (0, 50)}] * 6


def _marker(directory: Path, name: str, size: int, age_s: float) -> Path:
    path = directory / name
    path.write_bytes(b"")
    os.truncate(path, size)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_a_dead_workers_marker_is_not_shown_and_is_swept_and_the_further_of_two_shows(tmp_path: Path) -> None:
    _marker(tmp_path, "download-3-4-7-50-0123456789abcdef.part", 40, age_s=STALE_S + 1)  # its worker died
    _marker(tmp_path, "download-3-4-7-50-1123456789abcdef.part", 10, age_s=1)
    _marker(tmp_path, "download-3-4-7-50-2123456789abcdef.part", 25, age_s=2)  # a resumed one beside its cut one
    _marker(tmp_path, "download-3-4-8-90-3123456789abcdef.part", 0, age_s=0)
    other = _marker(tmp_path, "session-1-2-3-" + "a" * 64 + ".part", 5, age_s=STALE_S + 1)  # not a marker
    downloads = DownloadsUnderWay(tmp_path)
    assert downloads.held() == {(3, 7): (25, 50), (3, 8): (0, 90)}
    assert downloads.sweep() == 1
    assert sorted(path.name[:19] for path in tmp_path.glob("download-*")) == [
        "download-3-4-7-50-1",
        "download-3-4-7-50-2",
        "download-3-4-8-90-3",
    ]
    assert other.exists()
    assert DownloadsUnderWay(tmp_path / "absent").held() == {}


def _site_transfers(direct: httpx.Client, viewer: dict[str, str], site: str) -> list[dict[str, Any]]:
    status = direct.get("/api/v1/status", headers=viewer)
    assert status.status_code == 200, status.text
    (shown,) = (s for s in status.json()["sites"] if s["name"] == site)
    return list(shown["transfers"])


@pytest.fixture()
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """A model download sends its first chunk, then waits for this event to send the rest (or 30 s)."""
    opened = threading.Event()
    cached, read = global_models._slices, global_models.blob_chunks

    async def gated_slices(*args: Any, **kwargs: Any) -> AsyncIterator[memoryview]:
        async for index, chunk in _numbered(cached(*args, **kwargs)):
            if index == 1:
                await anyio.to_thread.run_sync(opened.wait, 30)
            yield chunk

    def gated_chunks(*args: Any, **kwargs: Any) -> Iterator[bytes | memoryview]:
        for index, chunk in enumerate(read(*args, **kwargs)):
            if index == 1:
                opened.wait(30)
            yield chunk

    monkeypatch.setattr(global_models, "_slices", gated_slices)
    monkeypatch.setattr(global_models, "blob_chunks", gated_chunks)
    return opened


async def _numbered(chunks: AsyncIterator[memoryview]) -> AsyncIterator[tuple[int, memoryview]]:
    index = 0
    async for chunk in chunks:
        yield index, chunk
        index += 1


@pytest.mark.usefixtures("every_chunk")
def test_the_status_shows_a_sites_download_under_way_until_it_ends(
    settings: CoordinatorSettings, gate: threading.Event
) -> None:
    with (
        served(create_app(settings)) as address,
        httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=60) as direct,
    ):
        study_id, headers = running_study(direct, sites=("lyon",), model={"preset": "small", "heads": "6:2"})
        task = next_task(direct, headers["lyon"])
        viewer = issue(direct, "viewer")
        assert _site_transfers(direct, viewer, "lyon") == []
        gate.set()
        size = len(direct.get(task["global_model_url"], headers=issue(direct, "researcher")).content)
        assert size > 2 * CHUNK_BYTES and _site_transfers(direct, viewer, "lyon") == []  # not a site's transfer
        gate.clear()
        with direct.stream("GET", task["global_model_url"], headers=headers["lyon"]) as response:
            body = response.iter_raw(CHUNK_BYTES)
            taken = len(next(body))
            assert _site_transfers(direct, viewer, "lyon") == [
                {
                    "study_id": study_id,
                    "round": 1,  # the round theta^g_0 goes out for
                    "round_id": task["round_id"],
                    "direction": "download",
                    "bytes_done": CHUNK_BYTES,  # its first chunk, sent; the next waits
                    "bytes_total": size,
                }
            ]
            gate.set()
            taken += sum(len(chunk) for chunk in body)
        assert taken == size
        for _ in range(200):  # the response's last step runs just after the client has the last byte
            if not _site_transfers(direct, viewer, "lyon"):
                break
            time.sleep(0.02)
        assert _site_transfers(direct, viewer, "lyon") == []
        markers = Path(str(settings.blob_dir)) / "downloads"
        assert list(markers.iterdir()) == []
