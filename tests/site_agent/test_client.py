"""The agent's HTTP client: what it puts on the wire for an upload."""

import json
import os

import httpx

from site_agent import client as client_module
from site_agent.client import CoordinatorClient


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
