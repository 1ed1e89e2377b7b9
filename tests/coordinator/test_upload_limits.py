"""An update's size limit follows its study's declared model: a model of any size takes part, padding does not."""

from __future__ import annotations

import hashlib

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from coordinator.rounds.updates import HEADER_ALLOWANCE_BYTES, upload_limit
from shared.tensors.codec import load
from shared.wire.protocol import UPLOAD_SHA256_HEADER
from tests.coordinator.factories import download, next_task, running_study, shifted, update_body


def _tensor_bytes(client: TestClient, task: dict, headers: dict[str, str]) -> int:
    """The bytes of theta^g's tensors, as the site downloads them."""
    response = client.get(task["global_model_url"], headers=headers)
    tensors, _ = load(response.content)
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def test_the_limit_is_the_declared_tensors_and_the_headers_room(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    _, headers = running_study(client, sites=("lyon",))
    task = next_task(client, headers["lyon"])
    declared = _tensor_bytes(client, task, headers["lyon"]) + HEADER_ALLOWANCE_BYTES
    with sessions() as session:
        assert upload_limit(session, task["round_id"], None) == declared
        assert upload_limit(session, task["round_id"], 5000) == 5000  # the operator's cap, when lower
        assert upload_limit(session, 10**9, None) == HEADER_ALLOWANCE_BYTES  # no such round: no model's room
    base = download(client, task["global_model_url"], headers["lyon"])
    accepted = client.post(
        task["update_url"],
        content=update_body(shifted(base, 0.1), 5),
        headers={**headers["lyon"], "Content-Type": "application/octet-stream"},
    )
    assert accepted.status_code == 201, accepted.text


def test_a_body_above_its_rounds_declared_size_is_refused_both_ways(client: TestClient) -> None:
    _, headers = running_study(client, sites=("lyon",))
    task = next_task(client, headers["lyon"])
    padded = b"\0" * (_tensor_bytes(client, task, headers["lyon"]) + HEADER_ALLOWANCE_BYTES + 1)
    plain = {**headers["lyon"], "Content-Type": "application/octet-stream"}
    whole = client.post(task["update_url"], content=padded, headers=plain)
    announced = client.post(
        task["update_url"],
        content=padded,
        headers={**plain, UPLOAD_SHA256_HEADER: hashlib.sha256(padded).hexdigest()},
    )
    for response in (whole, announced):
        assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large", response.text
