"""The agent's HTTP client: what it puts on the wire for an upload."""

import json
import os

import httpx
import pytest

from shared.wire.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_HEADER, PROTOCOL_VERSION
from site_agent import client as client_module
from site_agent.client import CoordinatorClient
from site_agent.errors import UpgradeRequired
from tests.coordinator.factories import next_task, running_study


def test_an_upload_is_sent_in_pieces_under_one_content_length(monkeypatch) -> None:
    monkeypatch.setattr(client_module, "UPLOAD_PIECE_BYTES", 1000)
    body = os.urandom(4321)
    seen: dict = {}

    class Wire(httpx.BaseTransport):
        """Takes the request body piece by piece, as a socket transport writes it."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
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
