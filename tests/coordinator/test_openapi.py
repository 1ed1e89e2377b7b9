"""The OpenAPI document declares every operation's roles and errors; the protocol page's roles agree with it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.api.roles import ADMIN, ANY_TOKEN, NO_TOKEN, RESEARCHER, ROUTES, SITE, VIEWER, Roles
from coordinator.models import Role
from tests.coordinator.factories import ADMIN as ADMIN_HEADERS
from tests.coordinator.factories import running_study

PROTOCOL_PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture" / "protocol.md"
ERROR_BODY = {"$ref": "#/components/schemas/ErrorBody"}


@pytest.fixture()
def document(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, item in document["paths"].items() for method, op in item.items()]


def _errors(operation: dict[str, Any]) -> set[int]:
    return {int(status) for status in operation["responses"] if int(status) >= 400}


def test_every_error_of_every_operation_has_the_error_body(document: dict[str, Any]) -> None:
    operations = _operations(document)
    assert len(operations) >= 25
    for method, path, operation in operations:
        for status in _errors(operation):
            content = operation["responses"][str(status)]["content"]
            assert content == {"application/json": {"schema": ERROR_BODY}}, (method, path, status)
    schemas = document["components"]["schemas"]
    assert schemas["ErrorBody"]["required"] == ["error"]
    assert set(schemas["ErrorInfo"]["required"]) == {"code", "message"}
    assert "HTTPValidationError" not in str(document)  # FastAPI's 422 body, which the app never sends


def test_every_operation_declares_the_errors_its_roles_and_parameters_imply(document: dict[str, Any]) -> None:
    for method, path, operation in _operations(document):
        access = ROUTES[(method.upper(), path)]
        errors = _errors(operation)
        assert (401 in errors) == (access.roles != NO_TOKEN), (method, path)
        assert (403 in errors) == (access.roles not in (NO_TOKEN, ANY_TOKEN)), (method, path)
        # a site-only route tells a site 403 for a study or round not its own, whether or not it exists: no 404,
        # but for an upload session of its own round that is gone
        own = path.endswith("/sessions/{sha256}")
        assert (404 in errors) == ("{" in path and (access.roles != SITE or own)), (method, path)
        assert (409 in errors) == access.conflicts, (method, path)
        assert (426 in errors) == (Role.SITE in access.roles), (method, path)
        if "{" in path or method == "post":
            assert 422 in errors, (method, path)
        assert ("security" in operation) == (access.roles != NO_TOKEN), (method, path)
        assert not any(p["name"].lower() == "authorization" for p in operation.get("parameters", []))


@pytest.mark.parametrize(
    ("method", "path", "errors"),
    [
        ("post", "/api/v1/rounds/{round_id}/updates", {401, 403, 409, 413, 415, 422, 426}),
        ("get", "/api/v1/studies/{study_id}/models/{number}", {401, 403, 404, 416, 422, 426}),  # 416: a Range past it
        ("post", "/api/v1/studies/{study_id}/start", {401, 403, 404, 409, 422}),
        ("post", "/api/v1/sites", {401, 403, 409, 422}),
        ("get", "/api/v1/studies", {401, 403}),
        ("get", "/api/v1/tokens/me", {401, 426}),  # a site agent too old for this coordinator: 426
        ("get", "/api/v1/health", {503}),  # its database does not answer
    ],
)
def test_the_errors_of_some_operations_exactly(document: dict[str, Any], method: str, path: str, errors: set) -> None:
    assert _errors(document["paths"][path][method]) == errors


def test_operations_name_their_roles(document: dict[str, Any]) -> None:
    models = document["paths"]["/api/v1/studies/{study_id}/models/{number}"]["get"]
    assert models["description"].endswith("Roles: admin, researcher, site.")
    assert document["paths"]["/api/v1/health"]["get"]["description"].endswith("Roles: anyone, without a token.")
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "an API token (cfl_...)",
    }


def test_a_download_answers_a_documented_304_when_the_client_has_the_model(client: TestClient) -> None:
    study_id, _ = running_study(client, sites=("lyon",))
    url = f"/api/v1/studies/{study_id}/models/0"
    etag = client.get(url, headers=ADMIN_HEADERS).headers["etag"]
    for tag in (etag, "*"):
        response = client.get(url, headers={**ADMIN_HEADERS, "If-None-Match": tag})
        assert response.status_code == 304 and response.headers["etag"] == etag
    paths = client.get("/openapi.json").json()["paths"]
    for template in ("/api/v1/studies/{study_id}/models/{number}", "/api/v1/studies/{study_id}/models/{number}/local"):
        assert {"304", "206", "416"} <= set(paths[template]["get"]["responses"])
        assert {"if-none-match", "range", "if-range"} <= {p["name"] for p in paths[template]["get"]["parameters"]}


def test_a_body_that_is_not_text_is_an_invalid_request(client: TestClient) -> None:
    response = client.post(
        "/api/v1/sites", content=b"\xff\xfe\x00garbage", headers={**ADMIN_HEADERS, "Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"


# docs/architecture/protocol.md's tables: `METHOD /path` cells, then the least role ("viewer": any person), "site",
# "any token", "none".
LEAST_ROLE: dict[str, Roles] = {
    "admin": ADMIN,
    "researcher": RESEARCHER,
    "viewer": VIEWER,
    "site": SITE,
    "any token": ANY_TOKEN,
    "none": NO_TOKEN,
}
ROW = re.compile(r"^\| (?P<routes>`(?:GET|POST|PUT|PATCH|DELETE) /[^|]*) \| (?P<roles>[^|]*) \|", re.MULTILINE)
OPERATION = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`?]*)")


def _shape(path: str) -> str:
    """The path with every parameter and number (a documented round 0) as {}."""
    return re.sub(r"\{[^}]+\}|(?<=/)\d+(?=/|$)", "{}", path)


def _documented_roles() -> dict[tuple[str, str], Roles]:
    """(method, path shape) -> roles, from the protocol page's tables of the REST API."""
    text = PROTOCOL_PAGE.read_text(encoding="utf-8")
    section = text[text.index("\n## REST API") :]
    section = section[: section.index("\n## ", 1)]
    documented: dict[tuple[str, str], Roles] = {}
    for row in ROW.finditer(section):
        names = re.sub(r"\([^)]*\)", "", row["roles"]).split(",")
        roles = frozenset().union(*(LEAST_ROLE[name.strip()] for name in names))
        for method, path in OPERATION.findall(row["routes"]):
            key = (method, _shape("/api/v1" + path))
            documented[key] = documented.get(key, frozenset()) | roles
    return documented


def test_the_protocol_page_names_the_roles_of_every_api_route() -> None:
    table = {(m, _shape(path)): access.roles for (m, path), access in ROUTES.items() if path.startswith("/api/v1/")}
    assert len(table) >= 25
    assert _documented_roles() == table
