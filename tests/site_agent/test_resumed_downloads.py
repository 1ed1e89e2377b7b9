"""A download cut mid-transfer resumes where it stopped: through a proxy that cuts at 10%, 50% and 90% of the body."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import torch
from sqlalchemy.orm import Session

from coordinator.config import CoordinatorSettings
from coordinator.db import make_engine
from coordinator.main import create_app
from coordinator.storage.blobs import read_blob
from shared.tensors.codec import load
from site_agent.client import CoordinatorClient
from tests.coordinator.factories import next_task, running_study
from tests.support.cutting_proxy import cutting_proxy
from tests.support.live_server import served

HEADS_ALLOWANCE = 2048  # the heads of the two responses, each some 300 bytes


@dataclass(frozen=True)
class Served:
    """A live coordinator with a study of a few-MB model, and a site's view of its round-0 task."""

    address: tuple[str, int]
    headers: dict[str, str]
    url: str
    sha256: str
    stored: bytes


@pytest.fixture()
def live(coordinator_settings: CoordinatorSettings) -> Iterator[Served]:
    with served(create_app(coordinator_settings)) as address:
        with httpx.Client(base_url=f"http://{address[0]}:{address[1]}") as direct:
            _, headers = running_study(direct, sites=("lyon",), model={"preset": "small", "heads": "6:2"})
            task = next_task(direct, headers["lyon"])
        engine = make_engine(coordinator_settings.database_url)
        with Session(engine) as session:
            stored = read_blob(session, task["global_model_sha256"])
        engine.dispose()
        yield Served(address, headers["lyon"], task["global_model_url"], task["global_model_sha256"], stored)


@contextmanager
def _agent(url: str, headers: dict[str, str]) -> Iterator[CoordinatorClient]:
    with httpx.Client(base_url=url, headers={"Authorization": headers["Authorization"]}) as http:
        yield CoordinatorClient(http, resume_delay_s=0.01)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_a_download_cut_mid_body_resumes_and_sends_each_byte_about_once(
    live: Served, fraction: float, caplog: pytest.LogCaptureFixture
) -> None:
    payload = len(live.stored)
    assert payload > 2_000_000  # a few MB: the cut falls deep inside the body
    cut = int(payload * fraction)
    with (
        cutting_proxy(live.address, cut_after=cut, direction="down") as proxy,
        _agent(proxy.url, live.headers) as agent,
        caplog.at_level(logging.INFO),
    ):
        body = agent.download(live.url, live.sha256)
    assert proxy.cuts == 1
    assert bytes(body) == live.stored and hashlib.sha256(body).hexdigest() == live.sha256
    received, stored = load(bytes(body))[0], load(live.stored)[0]
    assert received.keys() == stored.keys()
    assert all(torch.equal(received[name], stored[name]) for name in stored)
    assert agent.bytes_received == payload  # the body's bytes, none of them twice
    assert proxy.read["down"] <= 1.1 * payload + HEADS_ALLOWANCE  # all the coordinator's bytes that left its socket
    assert proxy.forwarded["down"] - payload < HEADS_ALLOWANCE
    resumed = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    assert len(resumed) == 1 and f"cut after {cut} of {payload} bytes" in resumed[0]
    print(f"cut at {fraction:.0%}: {proxy.read['down'] / payload:.4f} x the payload read from the coordinator")


def test_without_a_cut_the_proxy_passes_the_download_whole(live: Served) -> None:
    with cutting_proxy(live.address, cut_after=None) as proxy, _agent(proxy.url, live.headers) as agent:
        assert bytes(agent.download(live.url, live.sha256)) == live.stored
    assert proxy.cuts == 0 and proxy.read == proxy.forwarded
    assert len(live.stored) < proxy.forwarded["down"] < len(live.stored) + HEADS_ALLOWANCE // 2
