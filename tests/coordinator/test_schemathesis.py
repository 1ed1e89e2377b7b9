"""Schemathesis against the running app, as each caller, on SQLite and PostgreSQL.

Every operation of the OpenAPI document gets generated requests, valid and invalid ones; each
answer must be no server error and must match the document: its status is documented, its content
type is the documented one, its body fits the documented schema. Callers that may not call an
operation get 403, which is documented too. Path parameters are sometimes the ids of a running
study, so that answers other than 404 are checked as well.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

from coordinator.config import CoordinatorSettings
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, issue, next_task, running_study

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 12  # per operation and caller: the whole module takes about a minute on two cores
BASE_URL = "http://testserver"


@pytest.fixture()
def settings(database_url: str, blob_dir: Path) -> CoordinatorSettings:
    """The conftest's settings, with a long-poll that answers at once: a generated `wait` costs nothing."""
    return coordinator_settings_for(database_url, blob_dir=str(blob_dir), max_poll_wait_s=0)


def _world(client: TestClient) -> tuple[dict[str, dict[str, str]], dict[str, Any]]:
    """(caller -> headers, known values of parameters by name) of a running study with one site."""
    study_id, sites = running_study(client, sites=("lyon",))
    round_id = next_task(client, sites["lyon"])["round_id"]
    callers = {"admin": ADMIN, "researcher": issue(client, "researcher"), "viewer": issue(client, "viewer")}
    token_id = client.get("/api/v1/tokens/me", headers=callers["viewer"]).json()["token_id"]
    known = {"study_id": study_id, "round_id": round_id, "number": 0, "name": "lyon", "token_id": token_id}
    known["kind"] = "survey"  # a site report's kind (the study is a training one: its survey report is refused)
    known["if-none-match"] = "*"  # a download answers 304
    known["sha256"] = "0" * 64  # an upload session that does not exist: 404
    return callers | {"site": sites["lyon"]}, known


def _cases(operation: APIOperation, parameters: list[dict[str, Any]], known: dict[str, Any]) -> st.SearchStrategy[Case]:
    """Valid requests, valid requests to the running study's resources (with known headers too), invalid requests."""
    path = {p["name"]: known[p["name"]] for p in parameters if p["in"] == "path"}
    headers = {p["name"]: known[p["name"]] for p in parameters if p["in"] == "header" and p["name"] in known}
    strategies = [
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.POSITIVE, path_parameters=path),
        operation.as_strategy(GenerationMode.NEGATIVE),
    ]
    if headers:
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE, path_parameters=path, headers=headers))
    return st.one_of(strategies)


def _send(client: TestClient, case: Case, auth: dict[str, str]) -> None:
    """Send the case through the test client as the caller, and check the answer against the document."""
    request = case.as_transport_kwargs(base_url=BASE_URL)
    headers = {name: value for name, value in request["headers"].items() if name.lower() != "authorization"}
    headers |= auth
    body = request.get("data")
    response = client.request(
        request["method"],
        request["url"],
        headers=headers,
        params=request.get("params"),
        content=body if isinstance(body, bytes | str) else None,
        json=request.get("json"),
    )
    case.validate_response(response, checks=CHECKS, headers=headers)


def _run(
    client: TestClient,
    operation: APIOperation,
    parameters: list[dict[str, Any]],
    known: dict[str, Any],
    auth: dict[str, str],
) -> None:
    """Run the operation's generated cases; Hypothesis shrinks a failing one and raises it."""

    @hypothesis.given(case=_cases(operation, parameters, known))
    @hypothesis.settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    def check(case: Case) -> None:
        _send(client, case, auth)

    check()


@pytest.mark.parametrize("caller", ["admin", "researcher", "viewer", "site"])
def test_every_answer_is_as_documented(client: TestClient, caller: str) -> None:
    callers, known = _world(client)
    document = client.app.openapi()
    schema = schemathesis.openapi.from_dict(document)
    failures: dict[str, str] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25
    for operation in operations:
        parameters = document["paths"][operation.path][operation.method.lower()].get("parameters", [])
        try:
            _run(client, operation, parameters, known, callers[caller])
        except FailureGroup as failure:
            failures[operation.label] = re.sub(r"\n{3,}", "\n\n", str(failure))
    assert not failures, "\n".join(f"{label}:\n{text}" for label, text in failures.items())
