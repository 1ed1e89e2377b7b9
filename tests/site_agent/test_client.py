"""The agent's HTTP client: what it puts on the wire for an upload."""

import json
import os

import httpx
import pytest

from shared.wire.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_HEADER, PROTOCOL_VERSION
from site_agent import client as client_module
from site_agent import resumable_upload
from site_agent.client import CoordinatorClient
from site_agent.errors import UpgradeRequired
from tests.coordinator.factories import next_task, running_study


def test_an_upload_is_sent_in_pieces_under_one_content_length(monkeypatch) -> None:
    monkeypatch.setattr(resumable_upload, "UPLOAD_PIECE_BYTES", 1000)
    body = os.urandom(4321)
    seen: dict = {}

    class Wire(httpx.BaseTransport):
        """Takes the request body piece by piece, as a socket transport writes it."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/sessions"):  # a coordinator without upload sessions: the body goes whole
                return httpx.Response(404, json={"error": {"code": "not_found", "message": "Not Found"}})
            seen.update(headers=request.headers, pieces=list(request.stream))
            receipt = {
                "study_id": 1, "round_id": 2, "round": 1, "site": "lyon", "sha256": "0" * 64, "size": len(body),
                "num_examples": 3, "received_at": "2026-11-30T00:00:00Z",
            }  # fmt: skip
            return httpx.Response(201, content=json.dumps(receipt).encode())

    http = httpx.Client(transport=Wire(), base_url="http://coordinator")
    receipt = CoordinatorClient(http).upload("/api/v1/rounds/2/updates", body)
    assert receipt.round_id == 2
    assert seen["headers"]["content-length"] == str(len(body))
    assert "transfer-encoding" not in seen["headers"]  # not chunked: the length is known up front
    assert [len(piece) for piece in seen["pieces"]] == [1000, 1000, 1000, 1000, 321]
    assert b"".join(bytes(piece) for piece in seen["pieces"]) == body


def test_a_download_arrives_in_a_buffer_of_its_own_and_is_checked_against_its_digest() -> None:
    import hashlib

    import pytest

    from site_agent.errors import IntegrityError

    body = os.urandom(3 * 1024 * 1024 + 17)
    digest = hashlib.sha256(body).hexdigest()
    announced = {"length": len(body)}

    def handler(request: httpx.Request) -> httpx.Response:
        data = body[: announced["length"]]
        return httpx.Response(200, content=data, headers={"Content-Length": str(len(data))})

    client = CoordinatorClient(httpx.Client(transport=httpx.MockTransport(handler), base_url="http://coordinator"))
    received = client.download("/model", digest)
    assert isinstance(received, bytearray) and received == body and client.bytes_received == len(body)
    with pytest.raises(IntegrityError, match="differs from the announced"):
        client.download("/model", "0" * 64)
    announced["length"] = len(body) - 5  # cut short on the way
    with pytest.raises(IntegrityError):
        client.download("/model", digest)


def _serving(task: dict | None, status: int = 200, seen: list | None = None) -> CoordinatorClient:
    """A client whose coordinator answers every request with `task` (or an error body when status >= 400)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request.headers)
        if status >= 400:
            error = {"error": {"code": "agent_too_old", "message": "upgrade the site agent (cardiofl)"}}
            return httpx.Response(status, json=error)
        return httpx.Response(status, json=task)

    return CoordinatorClient(httpx.Client(transport=httpx.MockTransport(handler), base_url="http://coordinator"))


@pytest.fixture()
def real_task(coordinator) -> dict:  # noqa: ANN001 - the coordinator app's TestClient
    """A task exactly as this release's coordinator sends it."""
    _, headers = running_study(coordinator)
    return next_task(coordinator, headers["oslo"])


def test_every_request_says_which_protocol_the_agent_speaks(real_task: dict) -> None:
    seen: list = []
    client = _serving(real_task, seen=seen)
    task = client.next_task()
    assert task is not None and task.protocol == PROTOCOL_VERSION and task.study_uid == real_task["study_uid"]
    assert seen[-1][PROTOCOL_HEADER] == str(PROTOCOL_VERSION)


@pytest.mark.parametrize(
    ("version", "upgrade"),
    [
        (PROTOCOL_VERSION + 1, "upgrade the site agent"),
        ("3", "upgrade the site agent"),  # not even a number this agent knows
        (MIN_PROTOCOL_VERSION - 1, "upgrade the coordinator"),
        (None, "upgrade the coordinator"),  # a coordinator of cardiofl 0.1 sends no version
    ],
)
def test_a_task_of_a_protocol_the_agent_does_not_speak_stops_it_saying_what_to_upgrade(
    real_task: dict, version: object, upgrade: str
) -> None:
    task = {k: v for k, v in real_task.items() if k != "protocol"}
    if version is not None:
        task["protocol"] = version
    with pytest.raises(UpgradeRequired, match=upgrade):
        _serving(task).next_task()


def test_a_coordinator_that_no_longer_serves_the_agent_stops_it() -> None:
    with pytest.raises(UpgradeRequired, match="upgrade the site agent"):
        _serving(None, status=426).next_task()


class _CutStream(httpx.SyncByteStream):
    """A body whose connection drops after `data`, as a transfer cut on the way."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __iter__(self):  # noqa: ANN204 - httpx's stream protocol
        if self.data:
            yield self.data
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def _cut(status: int, data: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.Response(status, stream=_CutStream(data), headers=headers)


def test_a_cut_download_resumes_from_its_last_byte_and_starts_over_when_the_blob_changed(caplog) -> None:
    import hashlib
    import logging

    old, new = os.urandom(50_000), os.urandom(60_000)
    tag = {"old": f'"{hashlib.sha256(old).hexdigest()}"', "new": f'"{hashlib.sha256(new).hexdigest()}"'}
    asked: list[tuple[str | None, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((request.headers.get("range"), request.headers.get("if-range")))
        if len(asked) == 1:  # the old blob, cut at 20,000 bytes
            return _cut(200, old[:20_000], {"Content-Length": str(len(old)), "ETag": tag["old"]})
        if len(asked) == 2:  # the blob changed meanwhile: If-Range fails, the whole new one comes, cut again
            return _cut(200, new[:30_000], {"Content-Length": str(len(new)), "ETag": tag["new"]})
        rest = new[30_000:]
        headers = {"Content-Range": f"bytes 30000-{len(new) - 1}/{len(new)}", "ETag": tag["new"]}
        return httpx.Response(206, content=rest, headers=headers)

    client = CoordinatorClient(
        httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c"), resume_delay_s=0.001
    )
    with caplog.at_level(logging.INFO, logger="site_agent.client"):
        received = client.download("/model", hashlib.sha256(new).hexdigest())
    assert received == new and len(received) == len(new)
    assert asked == [(None, None), ("bytes=20000-", tag["old"]), ("bytes=30000-", tag["new"])]
    assert client.bytes_received == 20_000 + len(new)
    messages = [record.getMessage() for record in caplog.records]
    assert [m for m in messages if "resuming" in m][0].startswith("download of /model cut after 20000 of 50000 bytes")
    assert any("starting over from byte 0" in m for m in messages)


def test_a_download_that_makes_no_progress_gives_up_after_its_stalls() -> None:
    import hashlib

    from site_agent.errors import CoordinatorUnavailable, IntegrityError

    body = os.urandom(10_000)
    tag = f'"{hashlib.sha256(body).hexdigest()}"'
    ranges: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        ranges.append(request.headers.get("range"))
        if request.headers.get("range") is None:
            return _cut(200, body[:4_000], {"Content-Length": str(len(body)), "ETag": tag})
        return _cut(206, b"", {"Content-Range": f"bytes 4000-9999/{len(body)}", "ETag": tag})

    client = CoordinatorClient(
        httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c"), resume_delay_s=0.001
    )
    with pytest.raises(CoordinatorUnavailable, match="RemoteProtocolError"):
        client.download("/model", hashlib.sha256(body).hexdigest())
    assert ranges == [None] + ["bytes=4000-"] * client_module.DOWNLOAD_STALLS

    def elsewhere(request: httpx.Request) -> httpx.Response:  # a range that does not start where the bytes stop
        if request.headers.get("range") is None:
            return _cut(200, body[:4_000], {"Content-Length": str(len(body)), "ETag": tag})
        return httpx.Response(206, content=body[5000:], headers={"Content-Range": "bytes 5000-9999/10000"})

    client = CoordinatorClient(
        httpx.Client(transport=httpx.MockTransport(elsewhere), base_url="http://c"), resume_delay_s=0.001
    )
    with pytest.raises(IntegrityError, match="asked for the bytes from 4000, got bytes 5000-9999/10000"):
        client.download("/model", hashlib.sha256(body).hexdigest())
