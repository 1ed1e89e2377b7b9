"""Uploads cut mid-body resume from the bytes the coordinator holds (upload sessions), on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from coordinator.api.routes.upload_sessions import sweep_upload_sessions
from coordinator.config import CoordinatorSettings
from coordinator.main import create_app
from coordinator.models import Blob, Update
from coordinator.storage.blobs import blob_store_of
from coordinator.storage.update_files import FileBlobStore
from coordinator.storage.upload_sessions import SessionKey
from shared.wire.protocol import UPLOAD_OFFSET_HEADER, UPLOAD_SHA256_HEADER
from site_agent.client import CoordinatorClient
from tests.coordinator.factories import ADMIN, download, enrol, issue, next_task, running_study, shifted, update_body
from tests.support.cutting_proxy import cutting_proxy
from tests.support.live_server import served

HEADS_ALLOWANCE = 4096  # the heads of the requests after a cut (a GET, a PATCH), each some 400 bytes
OCTETS = {"Content-Type": "application/octet-stream"}


@dataclass(frozen=True)
class Round:
    """A site's task in a one-site study of a few-MB model, and the update it would send."""

    study_id: int
    headers: dict[str, str]
    task: dict[str, Any]
    body: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()

    @property
    def session(self) -> str:
        return f"{self.task['update_url']}/sessions/{self.sha256}"


def _round(client: httpx.Client) -> Round:
    study_id, headers = running_study(
        client, sites=("lyon",), model={"preset": "small", "heads": "6:2"}, keep_updates=True
    )
    task = next_task(client, headers["lyon"])
    tensors = download(client, task["global_model_url"], headers["lyon"])  # type: ignore[arg-type]
    return Round(study_id, headers["lyon"], task, update_body(shifted(tensors, 0.25), 40))


def _stored(sessions: sessionmaker[Session], round_id: int) -> list[bytes]:
    with sessions() as session:
        digests = session.scalars(select(Update.sha256).where(Update.round_id == round_id)).all()
        store = blob_store_of(session)
        assert isinstance(store, FileBlobStore)
        return [store.path(digest).read_bytes() for digest in digests]


def _round_status(client: httpx.Client, study_id: int) -> str:
    return str(client.get(f"/api/v1/studies/{study_id}/rounds/1", headers=ADMIN).json()["status"])


def _direct(address: tuple[str, int]) -> httpx.Client:
    return httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=60)


@contextmanager
def _agent(url: str, headers: dict[str, str]) -> Iterator[CoordinatorClient]:
    with httpx.Client(base_url=url, headers={"Authorization": headers["Authorization"]}, timeout=60) as http:
        yield CoordinatorClient(http, resume_delay_s=0.01)


def _settled(client: httpx.Client, study_id: int) -> str:
    for _ in range(400):  # the round closes after the answer (a background task), then aggregates
        status = _round_status(client, study_id)
        if status not in ("open", "aggregating"):
            return status
        time.sleep(0.02)
    return _round_status(client, study_id)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_an_upload_cut_mid_body_resumes_and_sends_each_byte_about_once(
    settings: CoordinatorSettings,
    sessions: sessionmaker[Session],
    fraction: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        served(create_app(settings)) as address,
        httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=60) as direct,
    ):
        round_ = _round(direct)
        payload = len(round_.body)
        assert payload > 2_000_000  # a few MB: the cut falls deep inside the body
        cut = int(payload * fraction)
        with (
            cutting_proxy(address, cut_after=cut, direction="up") as proxy,
            _agent(proxy.url, round_.headers) as agent,
            caplog.at_level(logging.INFO),
        ):
            receipt = agent.upload(round_.task["update_url"], round_.body)
        assert proxy.cuts == 1
        assert receipt.sha256 == round_.sha256 and receipt.size == payload
        assert _stored(sessions, round_.task["round_id"]) == [round_.body]  # once, bit for bit
        assert proxy.read["up"] <= 1.1 * payload  # every byte that left the agent's socket, heads included
        assert proxy.forwarded["up"] - payload < HEADS_ALLOWANCE  # the coordinator got each body byte once
        resumed = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
        held = [r.getMessage() for r in caplog.records if "the coordinator holds" in r.getMessage()]
        assert len(resumed) == 1 and len(held) == 1 and f"holds {cut} of {payload} bytes" in held[0]
        assert _settled(direct, round_.study_id) == "completed"
        assert settings.blob_dir is not None and not list((Path(settings.blob_dir) / "sessions").glob("*"))
        ratios = f"{proxy.read['up'] / payload:.4f} x sent, {proxy.forwarded['up'] / payload:.4f} x received"
        print(f"cut at {fraction:.0%}: {ratios} (of the payload)")


def test_a_restarted_agent_goes_on_from_the_bytes_held(
    settings: CoordinatorSettings, sessions: sessionmaker[Session]
) -> None:
    with (
        served(create_app(settings)) as address,
        httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=60) as direct,
    ):
        round_ = _round(direct)
        half = len(round_.body) // 2
        with cutting_proxy(address, cut_after=half, direction="up") as proxy, _agent(proxy.url, round_.headers) as gone:
            with pytest.raises(httpx.TransportError):  # the agent stops with its upload cut halfway
                gone.http.post(round_.task["update_url"], content=round_.body, headers=_whole(round_))
        with cutting_proxy(address, cut_after=None) as proxy, _agent(proxy.url, round_.headers) as agent:
            receipt = agent.upload(round_.task["update_url"], round_.body, resuming=True)
        assert receipt.sha256 == round_.sha256
        assert len(round_.body) - half < proxy.forwarded["up"] < len(round_.body) - half + HEADS_ALLOWANCE
        assert _stored(sessions, round_.task["round_id"]) == [round_.body]
        assert _settled(direct, round_.study_id) == "completed"


def _begin(client: TestClient, round_: Round, held: int) -> None:
    """A session holding the update's first `held` bytes, as a POST cut there leaves it (a TestClient cannot cut)."""
    client.app.state.coordinator.upload_sessions.start(_key(client, round_))
    answer = client.patch(round_.session, content=round_.body[:held], headers=_chunk(round_, 0))
    assert answer.status_code == 204 and answer.headers[UPLOAD_OFFSET_HEADER] == str(held)


def _key(client: TestClient, round_: Round) -> SessionKey:
    me = client.get("/api/v1/sites/me", headers=round_.headers).json()
    return SessionKey(round_.task["round_id"], me["id"], len(round_.body), round_.sha256)


def _whole(round_: Round) -> dict[str, str]:
    return {**round_.headers, **OCTETS, UPLOAD_SHA256_HEADER: round_.sha256}


def _chunk(round_: Round, offset: int) -> dict[str, str]:
    return {**round_.headers, "Content-Type": "application/offset+octet-stream", UPLOAD_OFFSET_HEADER: str(offset)}


def test_a_chunk_at_another_offset_is_refused_with_the_offset_held(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    round_ = _round(client)
    _begin(client, round_, 1000)
    held = client.get(round_.session, headers=round_.headers)
    assert held.status_code == 200 and held.json()["offset"] == 1000 and held.json()["size"] == len(round_.body)
    for wrong in (0, 999, 1001, len(round_.body)):
        refused = client.patch(round_.session, content=round_.body[wrong:], headers=_chunk(round_, wrong))
        assert refused.status_code == 409, wrong
        assert refused.json()["error"]["code"] == "upload_offset_mismatch"
        assert refused.headers[UPLOAD_OFFSET_HEADER] == "1000"
    posted = client.post(
        round_.task["update_url"],
        content=round_.body,
        headers={**round_.headers, **OCTETS, UPLOAD_SHA256_HEADER: round_.sha256},
    )
    assert posted.status_code == 409 and posted.headers[UPLOAD_OFFSET_HEADER] == "1000"  # the whole again: go on
    too_long = client.patch(round_.session, content=round_.body[1000:] + b"x", headers=_chunk(round_, 1000))
    assert too_long.status_code == 413
    assert _stored(sessions, round_.task["round_id"]) == []
    done = client.patch(round_.session, content=round_.body[1000:], headers=_chunk(round_, 1000))
    assert done.status_code == 201 and done.json()["sha256"] == round_.sha256
    assert _stored(sessions, round_.task["round_id"]) == [round_.body]
    assert client.get(round_.session, headers=round_.headers).status_code == 404  # finished: no session left
    again = client.post(
        round_.task["update_url"],
        content=round_.body,
        headers={**round_.headers, **OCTETS, UPLOAD_SHA256_HEADER: round_.sha256},
    )
    assert again.status_code == 200 and again.json() == done.json()


def test_bytes_that_are_not_the_announced_digest_are_refused_and_nothing_is_stored(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    round_ = _round(client)
    lying = Round(round_.study_id, round_.headers, round_.task, round_.body)
    other = bytearray(round_.body)
    other[-1] ^= 1
    _begin(client, lying, 1000)
    refused = client.patch(lying.session, content=bytes(other[1000:]), headers=_chunk(lying, 1000))
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "digest_mismatch"
    assert _stored(sessions, round_.task["round_id"]) == []
    assert client.get(lying.session, headers=lying.headers).status_code == 404
    assert _round_status(client, round_.study_id) == "open"
    audit = client.get(f"/api/v1/studies/{round_.study_id}/audit", headers=ADMIN).json()["data"]
    assert any(e["action"] == "update.refused" and "digest_mismatch" in str(e) for e in audit)


def test_another_site_or_round_cannot_reach_a_session(client: TestClient) -> None:
    round_ = _round(client)
    _begin(client, round_, 1000)
    graz = enrol(client, "graz")
    assert client.get(round_.session, headers=graz).status_code == 403
    assert client.patch(round_.session, content=b"x", headers={**_chunk(round_, 1000), **graz}).status_code == 403
    elsewhere = round_.session.replace(f"/rounds/{round_.task['round_id']}/", "/rounds/999/")
    assert client.get(elsewhere, headers=round_.headers).status_code == 403


def test_an_abandoned_session_or_one_of_a_closed_round_is_swept(client: TestClient) -> None:
    round_ = _round(client)
    _begin(client, round_, 1000)
    state = client.app.state.coordinator
    assert sweep_upload_sessions(state) == 0  # fresh, of an open round
    path = state.upload_sessions.path(_key(client, round_))
    old = time.time() - state.settings.upload_session_ttl_s - 60
    os.utime(path, (old, old))
    assert sweep_upload_sessions(state) == 1 and not path.exists()
    assert client.get(round_.session, headers=round_.headers).status_code == 404
    _begin(client, round_, 500)
    assert client.post(f"/api/v1/studies/{round_.study_id}/cancel", headers=ADMIN).status_code == 200
    assert sweep_upload_sessions(state) == 1
    assert client.get(round_.session, headers=round_.headers).status_code in (403, 404)
    refused = client.post(round_.task["update_url"], content=round_.body, headers=_whole(round_))
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "round_closed")  # as a whole body is
    assert state.upload_sessions.keys() == []


def _transfers(client: TestClient, site: str) -> list[dict[str, Any]]:
    status = client.get("/api/v1/status", headers=issue(client, "viewer"))
    assert status.status_code == 200, status.text
    (shown,) = (s for s in status.json()["sites"] if s["name"] == site)
    return list(shown["transfers"])


def test_the_status_shows_the_bytes_held_of_an_upload_under_way_until_it_is_accepted(client: TestClient) -> None:
    round_ = _round(client)
    assert _transfers(client, "lyon") == []  # nothing travels yet
    size, half = len(round_.body), len(round_.body) // 2
    _begin(client, round_, 1000)
    held = {
        "study_id": round_.study_id,
        "round": 1,
        "round_id": round_.task["round_id"],
        "direction": "upload",
        "bytes_done": 1000,
        "bytes_total": size,
    }
    assert _transfers(client, "lyon") == [held]
    assert client.patch(round_.session, content=round_.body[1000:half], headers=_chunk(round_, 1000)).status_code == 204
    assert _transfers(client, "lyon") == [{**held, "bytes_done": half}]
    done = client.patch(round_.session, content=round_.body[half:], headers=_chunk(round_, half))
    assert done.status_code == 201, done.text
    assert _transfers(client, "lyon") == []  # accepted: its update, no transfer any more


def test_a_session_of_a_round_no_longer_open_shows_no_transfer(client: TestClient) -> None:
    round_ = _round(client)
    _begin(client, round_, 1000)
    assert [t["bytes_done"] for t in _transfers(client, "lyon")] == [1000]
    assert client.post(f"/api/v1/studies/{round_.study_id}/cancel", headers=ADMIN).status_code == 200
    assert client.app.state.coordinator.upload_sessions.keys() != []  # not swept yet
    assert _transfers(client, "lyon") == []


def test_an_update_sent_whole_is_hashed_as_it_arrives_and_never_read_back(
    client: TestClient, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.storage.update_files import IncomingBlob

    def read_back(path: Path) -> IncomingBlob:
        raise AssertionError(f"{path} was read back: a session received whole is hashed as it arrives")

    monkeypatch.setattr(IncomingBlob, "of_file", staticmethod(read_back))
    round_ = _round(client)
    lying = bytearray(round_.body)
    lying[len(lying) // 2] ^= 1  # the announced digest is the true body's: these bytes differ by one bit
    refused = client.post(round_.task["update_url"], content=bytes(lying), headers=_whole(round_))
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "digest_mismatch"
    assert _stored(sessions, round_.task["round_id"]) == []
    accepted = client.post(round_.task["update_url"], content=round_.body, headers=_whole(round_))
    assert accepted.status_code == 201 and accepted.json()["sha256"] == round_.sha256
    assert _stored(sessions, round_.task["round_id"]) == [round_.body]
    with sessions() as session:
        stored = session.scalars(select(Update).where(Update.round_id == round_.task["round_id"])).one()
        checksums = session.get(Blob, stored.sha256).checksums  # the block checksums, as a read back computes them
    written = IncomingBlob(Path(client.app.state.coordinator.blob_store.root) / "check", named=False)
    written.write(round_.body)
    written.finish()
    assert checksums == written.checksums
    written.discard()


def test_a_session_swept_as_its_upload_begins_is_answered_as_gone(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.storage.update_files import IncomingBlob

    def swept(path: Path) -> IncomingBlob:
        path.unlink()  # its round closed and the sweep took it between the lock and the first byte
        raise FileNotFoundError(path)

    round_ = _round(client)
    monkeypatch.setattr(IncomingBlob, "over", staticmethod(swept))
    answer = client.post(round_.task["update_url"], content=round_.body, headers=_whole(round_))
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "upload_session_not_found"
