"""Every route that takes an id answers an id beyond what the database holds with a 422 error body, never a 500."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tests.coordinator.factories import ADMIN, enrol

ID = re.compile(r"\{(\w+_id|number)\}")


def _operations(client: TestClient) -> list[tuple[str, str]]:
    """(method, path template) of every documented operation whose path takes an id or a round number."""
    paths = client.app.openapi()["paths"]
    return [(method.upper(), path) for path, item in paths.items() if ID.search(path) for method in item]


@pytest.mark.parametrize("value", ["99999999999999999999", "9223372036854775808", "2147483648", "-1"])
def test_an_id_out_of_range_is_refused_on_every_route(client: TestClient, value: str) -> None:
    site = enrol(client, "lyon")
    operations = _operations(client)
    assert len(operations) >= 12  # studies, rounds, models, tokens, uploads
    for method, template in operations:
        answers = set()
        for headers in (ADMIN, site):
            response = client.request(method, ID.sub(value, template), headers=headers)
            # a caller without the route's role may be told so first; no one gets a 404 or a 500
            assert response.status_code in (403, 422), (method, template, response.status_code, response.text)
            answers.add(response.json()["error"]["code"])
        assert "invalid_request" in answers, (method, template, answers)


def test_the_largest_id_is_a_plain_not_found(client: TestClient) -> None:
    response = client.get("/api/v1/studies/2147483647", headers=ADMIN)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("text", ["a\x00b", "line\nbreak", "\x1b[31mred", "x" * 201])
def test_text_a_person_types_refuses_nul_and_control_characters(client: TestClient, text: str) -> None:
    from tests.coordinator.factories import study_config

    study = client.post("/api/v1/studies", json={"name": text, "config": study_config(["lyon"])}, headers=ADMIN)
    token = client.post("/api/v1/tokens", json={"role": "viewer", "label": text}, headers=ADMIN)
    for response in (study, token):
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "invalid_request"
    fine = client.post("/api/v1/tokens", json={"role": "viewer", "label": "Dr. Müller – cardiology"}, headers=ADMIN)
    assert fine.status_code == 201, fine.text


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/api/v1/sites", "GET, HEAD, POST"),
        ("PUT", "/api/v1/studies/1", "GET, HEAD"),
        ("PATCH", "/api/v1/tokens", "GET, HEAD, POST"),
        ("GET", "/api/v1/rounds/3/updates", "POST"),
    ],
)
def test_a_wrong_method_is_told_every_method_of_the_path(
    client: TestClient, method: str, path: str, allowed: str
) -> None:
    response = client.request(method, path, headers=ADMIN)
    assert response.status_code == 405
    assert response.headers["allow"] == allowed
    assert response.json()["error"]["code"] == "method_not_allowed"
