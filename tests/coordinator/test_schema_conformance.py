"""The API keeps its schema where it once did not: /tokens/me's other methods, strict booleans, rules across fields.

Regression tests of issue #51 item 7; tests/coordinator/test_schemathesis.py checks every operation against
the document at large (status codes, content types, response schemas).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any, cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.coordinator.factories import ADMIN, OCTETS, enrol, issue, next_task, running_study, study_config

API = "/api/v1"


def document(client: TestClient) -> dict[str, Any]:
    """The app's OpenAPI document."""
    return cast(FastAPI, client.app).openapi()


@pytest.mark.parametrize("method", ["DELETE", "OPTIONS", "PUT", "POST"])
def test_other_methods_on_tokens_me_are_405_with_its_allow_header(client: TestClient, method: str) -> None:
    response = client.request(method, f"{API}/tokens/me", headers=ADMIN)
    assert response.status_code == 405, response.text
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["allow"] == "GET, HEAD"


def test_a_token_is_still_revoked_by_its_numeric_id(client: TestClient) -> None:
    viewer = issue(client, "viewer")
    token_id = client.get(f"{API}/tokens/me", headers=viewer).json()["token_id"]
    assert client.delete(f"{API}/tokens/{token_id}", headers=ADMIN).status_code == 204
    assert client.get(f"{API}/tokens/me", headers=viewer).status_code == 401
    assert client.delete(f"{API}/tokens/999999", headers=ADMIN).status_code == 404


def test_the_document_keeps_the_revoke_path_and_its_integer_parameter(client: TestClient) -> None:
    paths = document(client)["paths"]
    assert set(paths[f"{API}/tokens/{{token_id}}"]) == {"delete"}
    (parameter,) = paths[f"{API}/tokens/{{token_id}}"]["delete"]["parameters"]
    assert parameter["name"] == "token_id" and parameter["schema"]["type"] == "integer"
    assert set(paths[f"{API}/tokens/me"]) == {"get"}


def _create(client: TestClient, config: dict[str, Any]) -> Any:
    return client.post(f"{API}/studies", json={"name": "trial", "config": config}, headers=ADMIN)


@pytest.mark.parametrize("value", [0, 1, "false", "true", None])
def test_keep_updates_takes_a_json_boolean_only(client: TestClient, value: Any) -> None:
    enrol(client, "lyon")
    response = _create(client, study_config(["lyon"], keep_updates=value))
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert "keep_updates" in response.json()["error"]["message"]


@pytest.mark.parametrize("value", [True, False])
def test_keep_updates_true_or_false_is_stored_as_given(client: TestClient, value: bool) -> None:
    enrol(client, "lyon")
    response = _create(client, study_config(["lyon"], keep_updates=value))
    assert response.status_code == 201, response.text
    assert response.json()["config"].get("keep_updates", False) is value


def test_the_request_schema_keeps_keep_updates_a_plain_boolean(client: TestClient) -> None:
    """StrictBool changes what is accepted, not the document: still `type: boolean`, no alternative types."""
    field = document(client)["components"]["schemas"]["StudyTerms-Input"]["properties"]["keep_updates"]
    assert field["type"] == "boolean" and field["default"] is False and "anyOf" not in field


def test_the_create_operation_documents_its_rules_across_fields_with_their_codes(client: TestClient) -> None:
    description = document(client)["paths"][f"{API}/studies"]["post"]["description"]
    for phrase in ("min_sites >= 2", "422 `invalid_request`", "422 `privacy_budget`", "422 `unknown_sites`"):
        assert phrase in description
    assert "422" in document(client)["paths"][f"{API}/studies"]["post"]["responses"]


def test_a_secure_study_of_one_site_quorum_is_refused_as_documented(client: TestClient) -> None:
    enrol(client, "lyon")
    enrol(client, "oslo")
    config = study_config(["lyon", "oslo"], min_sites=1, privacy={"secure_aggregation": {}})
    response = _create(client, config)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "min_sites" in error["message"] and ">= 2" in error["message"]


async def _upload_then_hang_up(
    client: TestClient, path: str, headers: dict[str, str]
) -> list[MutableMapping[str, Any]]:
    """POST `path` through the app's ASGI interface, sending part of the body before the client disconnects."""
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": b"\0" * 64, "more_body": True}]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()],
        "client": ("testclient", 50000),
        "server": ("testserver", 80),
        "state": dict(client.app_state),
    }
    await client.app(scope, receive, send)
    return sent


def test_a_client_that_hangs_up_mid_upload_is_one_info_line(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    _, sites = running_study(client, sites=("lyon",))
    task = next_task(client, sites["lyon"])
    path = task["update_url"].removeprefix("http://testserver")
    headers = {**sites["lyon"], **OCTETS, "Content-Length": "100000"}
    with caplog.at_level(logging.INFO):
        portal = client.portal
        assert portal is not None  # the client is started (the fixture's `with`)
        portal.call(_upload_then_hang_up, client, path, headers)
    gone = [record for record in caplog.records if "disconnected" in record.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert next_task(client, sites["lyon"])["round_id"] == task["round_id"]  # nothing was stored: still due


def test_a_rules_boolean_param_takes_a_json_boolean_only(client: TestClient) -> None:
    enrol(client, "lyon")
    algorithm = {"name": "learned_heads", "params": {"carve_trains_shared": 0}}
    response = _create(client, study_config(["lyon"], algorithm=algorithm))
    assert response.status_code == 422, response.text
    assert "algorithm.params.carve_trains_shared" in response.json()["error"]["message"]
    algorithm["params"] = {"carve_trains_shared": True}
    assert _create(client, study_config(["lyon"], algorithm=algorithm)).status_code == 201
