"""A download cut, then the agent restarted: it asks a live coordinator only for the rest, and checks the bytes kept."""

from __future__ import annotations

import hashlib
import json
import logging
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from site_agent import transfer_progress
from site_agent.client import CoordinatorClient
from site_agent.errors import CoordinatorUnavailable
from site_agent.kept_partials import kept_partials_dir
from tests.site_agent import test_resumed_downloads
from tests.site_agent.test_resumed_downloads import HEADS_ALLOWANCE, Served
from tests.support.cutting_proxy import cutting_proxy

Asked = list[tuple[str | None, str | None]]
model = test_resumed_downloads.live  # a live coordinator serving a study's few-MB model


class _LinkDown(httpx.BaseTransport):
    """A site's link that carries its first request, then is down: every later request fails to connect."""

    def __init__(self) -> None:
        self.inner, self.requests = httpx.HTTPTransport(), 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.requests > 1:
            raise httpx.ConnectError("the link is down", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@contextmanager
def _agent(url: str, served: Served, folder: Path, asked: Asked | None = None) -> Iterator[CoordinatorClient]:
    """A freshly started agent keeping its partial downloads in `folder`; its requests' ranges go to `asked`."""

    def record(request: httpx.Request) -> None:
        if asked is not None:
            asked.append((request.headers.get("range"), request.headers.get("if-range")))

    headers = {"Authorization": served.headers["Authorization"]}
    with httpx.Client(base_url=url, headers=headers, event_hooks={"request": [record]}) as http:
        yield CoordinatorClient(http, resume_delay_s=0.01, download_dir=folder)


def _cut_and_give_up(served: Served, folder: Path, cut: int) -> Path:
    """An agent whose download is cut `cut` bytes in, the link then down until it gives up: its kept bytes."""
    headers = {"Authorization": served.headers["Authorization"]}
    with cutting_proxy(served.address, cut_after=cut) as proxy:
        with httpx.Client(base_url=proxy.url, headers=headers, transport=_LinkDown()) as http:
            agent = CoordinatorClient(http, resume_delay_s=0.01, download_dir=folder)
            with pytest.raises(CoordinatorUnavailable, match="the link is down"):
                agent.download(served.url, served.sha256)
    assert proxy.cuts == 1
    return folder / f"{served.sha256}.part"


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    return kept_partials_dir(tmp_path / "store")


def test_a_restarted_agent_asks_only_for_the_bytes_it_lacks(
    model: Served, folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    payload = len(model.stored)
    cut = payload * 2 // 5
    part = _cut_and_give_up(model, folder, cut)
    assert part.stat().st_size == cut and part.read_bytes() == model.stored[:cut]
    assert stat.S_IMODE(part.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    meta = part.with_suffix(".json")
    assert stat.S_IMODE(meta.stat().st_mode) == 0o600
    assert json.loads(meta.read_bytes()) == {"etag": f'"{model.sha256}"', "size": payload}

    monkeypatch.setattr(transfer_progress, "PROGRESS_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(transfer_progress, "PROGRESS_STEP_BYTES", 64 << 10)
    monkeypatch.setattr(transfer_progress, "PROGRESS_INTERVAL_S", 0.0)
    asked: Asked = []
    with (
        cutting_proxy(model.address, cut_after=None) as proxy,
        _agent(proxy.url, model, folder, asked) as agent,
        caplog.at_level(logging.INFO, logger="site_agent"),
    ):
        body = agent.download(model.url, model.sha256)
    assert bytes(body) == model.stored and hashlib.sha256(body).hexdigest() == model.sha256
    assert asked == [(f"bytes={cut}-", f'"{model.sha256}"')]
    assert agent.bytes_received == payload - cut  # the rest, and only the rest, came over the link
    assert 0 < proxy.forwarded["down"] - (payload - cut) < HEADS_ALLOWANCE
    assert list(folder.iterdir()) == []  # finished: nothing kept
    messages = [record.getMessage() for record in caplog.records]
    assert (
        f"download of {model.url}: {cut} of {payload} bytes kept from an earlier start; asking for the rest" in messages
    )
    assert f"download of {model.url}: resumed from byte {cut} of {payload}" in messages
    lines = [
        m for m in messages if m.startswith(f"download of {model.url}: ") and m.endswith(f"resumed from byte {cut}")
    ]
    assert 4 <= len(lines) <= 7  # a tenth of the model each, from 40% on
    assert lines[-1] == f"download of {model.url}: {payload} of {payload} bytes (100%), resumed from byte {cut}"


def test_kept_bytes_whose_etag_no_longer_holds_are_dropped_for_the_whole_body(
    model: Served, folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    payload = len(model.stored)
    part = _cut_and_give_up(model, folder, payload // 2)
    meta = part.with_suffix(".json")
    meta.write_text(json.dumps({"etag": '"an-older-blob"', "size": payload}))
    asked: Asked = []
    with (
        _agent(f"http://{model.address[0]}:{model.address[1]}", model, folder, asked) as agent,
        caplog.at_level(logging.INFO),
    ):
        body = agent.download(model.url, model.sha256)
    assert bytes(body) == model.stored
    assert asked == [(f"bytes={payload // 2}-", '"an-older-blob"')]  # If-Range fails: the coordinator sends it all
    assert agent.bytes_received == payload
    assert any("sent the whole body again; starting over from byte 0" in r.getMessage() for r in caplog.records)
    assert list(folder.iterdir()) == []


def test_corrupted_kept_bytes_fail_the_digest_and_the_download_starts_over(
    model: Served, folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    payload = len(model.stored)
    cut = payload // 3
    part = _cut_and_give_up(model, folder, cut)
    spoiled = bytearray(part.read_bytes())
    spoiled[cut // 2] ^= 0xFF  # a bit flipped on disk
    part.write_bytes(spoiled)
    asked: Asked = []
    with (
        _agent(f"http://{model.address[0]}:{model.address[1]}", model, folder, asked) as agent,
        caplog.at_level(logging.INFO),
    ):
        body = agent.download(model.url, model.sha256)
    assert bytes(body) == model.stored
    assert asked == [(f"bytes={cut}-", f'"{model.sha256}"'), (None, None)]
    assert agent.bytes_received == (payload - cut) + payload
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"download of {model.url}: the bytes kept do not hash to {model.sha256}; starting over from byte 0"
    ]
    assert list(folder.iterdir()) == []
