"""Progress lines of big transfers, and the folder of kept partial downloads: what is logged, kept and swept."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
from pathlib import Path

import httpx
import pytest

from shared.wire.protocol import UPLOAD_OFFSET_HEADER
from site_agent import transfer_progress
from site_agent.client import CoordinatorClient
from site_agent.kept_partials import PARTIAL_MAX_AGE_S, KeptPartials
from site_agent.partial_body import PartialBody
from site_agent.transfer_progress import TransferProgress

MIB = 1 << 20
URL = "/api/v1/rounds/2/updates"


class _Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _progress_lines(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{what}: ") and " bytes" in r.getMessage()
    ]


@pytest.fixture()
def fine_grained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress worth logging from 1 MiB on, a line every tenth, however fast."""
    monkeypatch.setattr(transfer_progress, "PROGRESS_MIN_BYTES", MIB)
    monkeypatch.setattr(transfer_progress, "PROGRESS_STEP_BYTES", 64 << 10)
    monkeypatch.setattr(transfer_progress, "PROGRESS_INTERVAL_S", 0.0)


@pytest.mark.parametrize(("tick", "most"), [(0.5, 11), (0.001, 2)])
def test_a_big_transfer_logs_a_line_a_tenth_at_most_one_a_second(
    tick: float, most: int, caplog: pytest.LogCaptureFixture
) -> None:
    total = 1 << 30
    log = logging.getLogger("tests.progress")
    clock = _Clock()
    progress = TransferProgress(log, "download of /m", total, clock=clock)
    with caplog.at_level(logging.INFO, logger="tests.progress"):
        for done in range(MIB, total + 1, MIB):  # 1024 chunks: 512 s, or about a second, in all
            clock.now += tick
            progress.advance(done)
        progress.finish()
    lines = _progress_lines(caplog, "download of /m")
    assert len(lines) - 1 <= most and lines[-1] == f"download of /m: {total} of {total} bytes (100%)"
    if tick == 0.5:
        assert lines[0] == f"download of /m: {103 * MIB} of {total} bytes (10%)"  # the first MiB past a tenth


def test_a_small_transfer_logs_no_progress(caplog: pytest.LogCaptureFixture) -> None:
    body = os.urandom(3 * MIB)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"Content-Length": str(len(body))})

    client = CoordinatorClient(httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c"))
    with caplog.at_level(logging.INFO):
        assert client.download("/model", hashlib.sha256(body).hexdigest()) == body
    assert _progress_lines(caplog, "download of /model") == []


@pytest.mark.usefixtures("fine_grained")
def test_an_upload_resumed_after_a_restart_logs_its_progress_from_the_offset_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body, held = os.urandom(6 * MIB), 2 * MIB
    digest = hashlib.sha256(body).hexdigest()
    patched: list[tuple[str, int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the session: what the coordinator holds
            view = {"url": str(request.url.path), "offset": held, "size": len(body), "sha256": digest}
            return httpx.Response(200, json=view)
        patched.append((request.headers[UPLOAD_OFFSET_HEADER], len(request.read())))
        receipt = {
            "study_id": 1, "round_id": 2, "round": 1, "site": "lyon", "sha256": digest, "size": len(body),
            "num_examples": 3, "received_at": "2026-11-30T00:00:00Z",
        }  # fmt: skip
        return httpx.Response(201, json=receipt)

    client = CoordinatorClient(httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c"))
    with caplog.at_level(logging.INFO, logger="site_agent"):
        assert client.upload(URL, body, resuming=True).sha256 == digest
    assert patched == [(str(held), len(body) - held)]
    messages = [r.getMessage() for r in caplog.records]
    assert f"upload to {URL}: resumed from byte {held} of {len(body)}" in messages
    lines = _progress_lines(caplog, f"upload to {URL}")
    assert lines == [
        f"upload to {URL}: {(3 + i) * MIB} of {len(body)} bytes ({(3 + i) * 100 // 6}%), resumed from byte {held}"
        for i in range(3)
    ] + [f"upload to {URL}: {len(body)} of {len(body)} bytes (100%), resumed from byte {held}"]


@pytest.mark.usefixtures("fine_grained")
def test_a_download_logs_bytes_done_of_the_total_each_tenth(caplog: pytest.LogCaptureFixture) -> None:
    body = os.urandom(2 * MIB)
    pieces = [body[i : i + 64 * 1024] for i in range(0, len(body), 64 * 1024)]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter(pieces), headers={"Content-Length": str(len(body))})

    client = CoordinatorClient(httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c"))
    with caplog.at_level(logging.INFO, logger="site_agent.client"):
        assert client.download("/model", hashlib.sha256(body).hexdigest()) == body
    lines = _progress_lines(caplog, "download of /model")
    assert len(lines) == 10 and lines[-1] == f"download of /model: {len(body)} of {len(body)} bytes (100%)"
    assert lines[0] == f"download of /model: {4 * 64 * 1024} of {len(body)} bytes (12%)"  # the first piece past 10%


def test_bytes_kept_whole_before_a_restart_are_checked_without_asking_again(tmp_path: Path) -> None:
    body = os.urandom(100_000)
    digest = hashlib.sha256(body).hexdigest()
    (tmp_path / f"{digest}.part").write_bytes(body)
    (tmp_path / f"{digest}.json").write_text(json.dumps({"etag": f'"{digest}"', "size": len(body)}))

    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing is left to ask for")

    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c")
    client = CoordinatorClient(http, download_dir=tmp_path)
    assert client.download("/model", digest) == body and client.bytes_received == 0
    assert list(tmp_path.iterdir()) == []


def test_a_partial_is_kept_owner_only_and_a_second_download_of_it_keeps_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "downloads"
    partials, digest = KeptPartials(folder), "a" * 64
    first = partials.open(digest)
    assert first is not None and partials.open(digest) is None  # locked by the first download
    first.begin(10, '"a"')
    first.append(b"01234")
    first.close()
    part = folder / f"{digest}.part"
    assert part.read_bytes() == b"01234" and stat.S_IMODE(part.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    again = partials.open(digest)
    assert again is not None
    partial = PartialBody()
    assert again.load(partial) == 5 and partial.resume_headers() == {"Range": "bytes=5-", "If-Range": '"a"'}
    again.close()
    assert partials.open("../../etc/passwd") is None  # only a digest names a file


def test_old_and_surplus_partials_are_swept_when_a_download_starts(tmp_path: Path) -> None:
    partials = KeptPartials(tmp_path)
    now = time.time()
    ages = {"1": 60.0, "2": 120.0, "3": PARTIAL_MAX_AGE_S + 1}
    for name, age in ages.items():
        part = tmp_path / f"{name * 64}.part"
        part.write_bytes(b"x")
        part.with_suffix(".json").write_text("{}")
        os.utime(part, (now - age, now - age))
    (tmp_path / ("4" * 64 + ".json")).write_text("{}")  # a record whose bytes are gone
    current = partials.open("f" * 64)
    assert current is not None
    current.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1" * 64 + ".json", "1" * 64 + ".part", "f" * 64 + ".part"]
