"""A site learns nothing of studies and rounds not its own: an unknown id gets the very answer of another's (403).

And an upload of a site that is not a participant of the round is refused before a byte of its body is read.
Tests taking `client` run on SQLite and on PostgreSQL (tests/coordinator/conftest.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient

from coordinator.api import deps
from coordinator.api.deps import MAX_ID
from coordinator.api.roles import ROUTES, SITE
from tests.coordinator.factories import ADMIN, OCTETS, next_task, running_study

MISSING = MAX_ID  # an id no study or round has, and one the database's columns hold
SCOPED = re.compile(r"\{(study_id|round_id)\}")
# What each route that takes a body is sent: a body it takes, so that only who asks decides the answer.
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("PUT", "/api/v1/sites/me/studies/{study_id}/approval"): {"json": {"state": "approved", "digest": "0" * 64}},
    ("POST", "/api/v1/rounds/{round_id}/decline"): {"json": {"reason": "the terms differ"}},
    ("POST", "/api/v1/rounds/{round_id}/updates"): {"content": b"\0" * 4096, "headers": OCTETS},
    ("PATCH", "/api/v1/rounds/{round_id}/updates/sessions/{sha256}"): {
        "content": b"\0" * 4096,
        "headers": {**OCTETS, "Upload-Offset": "0"},
    },
    ("POST", "/api/v1/studies/{study_id}/reports/{kind}/{number}"): {
        "json": {
            "kind": "external",
            "evaluation": {"n_samples": 40, "loss": 0.5, "micro_f1": 0.5, "map": 0.5, "map_present": 0.5},
        }
    },
}
# The routes a site calls with a study's or a round's id: every one must be in the walk below.
SITE_ROUTES = {
    ("GET", "/api/v1/studies/{study_id}/models/{number}"),
    ("GET", "/api/v1/studies/{study_id}/models/{number}/local"),
    ("PUT", "/api/v1/sites/me/studies/{study_id}/approval"),
    ("POST", "/api/v1/rounds/{round_id}/updates"),
    ("GET", "/api/v1/rounds/{round_id}/updates/sessions/{sha256}"),
    ("PATCH", "/api/v1/rounds/{round_id}/updates/sessions/{sha256}"),
    ("POST", "/api/v1/rounds/{round_id}/decline"),
    ("GET", "/api/v1/rounds/{round_id}/secagg"),
    ("POST", "/api/v1/rounds/{round_id}/secagg/advertisement"),
    ("POST", "/api/v1/studies/{study_id}/reports/{kind}/{number}"),
}


@pytest.fixture()
def world(client: TestClient) -> dict[str, Any]:
    """Site lyon's study and round, and another study's and round of sites rome and kiel that lyon is not in."""
    ours, ours_sites = running_study(client, sites=("lyon", "oslo"))
    theirs, their_sites = running_study(client, sites=("rome", "kiel"))
    return {
        "lyon": ours_sites["lyon"],
        "ours": {"study_id": ours, "round_id": next_task(client, ours_sites["lyon"])["round_id"]},
        "theirs": {"study_id": theirs, "round_id": next_task(client, their_sites["rome"])["round_id"]},
    }


def _call(client: TestClient, method: str, template: str, ids: dict[str, int], headers: dict[str, str]) -> Any:
    url = template.replace("{kind}", "external").replace("{number}", "0").replace("{sha256}", "0" * 64).format(**ids)
    body = BODIES.get((method, template), {"json": {}} if method in ("POST", "PUT") else {})
    return client.request(method, url, **{**body, "headers": {**headers, **body.get("headers", {})}})


def _shape(response: httpx.Response, study_or_round_id: int) -> tuple[int, str, bytes]:
    """Status, content type and body, with the id asked about (as a whole number) written as <id>."""
    body = re.sub(rb"(?<!\d)%d(?!\d)" % study_or_round_id, b"<id>", response.content)
    return response.status_code, response.headers["content-type"], body


def _scoped_routes() -> list[tuple[str, str]]:
    return sorted(key for key in ROUTES if SCOPED.search(key[1]))


def test_the_walk_covers_every_route_a_site_calls_with_a_study_or_round() -> None:
    site_scoped = {key for key in _scoped_routes() if SITE <= ROUTES[key].roles}
    assert site_scoped >= SITE_ROUTES, SITE_ROUTES - site_scoped


@pytest.mark.parametrize(("method", "template"), _scoped_routes(), ids=[f"{m} {t}" for m, t in _scoped_routes()])
def test_a_site_gets_one_answer_for_an_unknown_id_and_for_one_not_its_own(
    client: TestClient, world: dict[str, Any], method: str, template: str
) -> None:
    """Status, code and message alike, byte for byte but for the id itself: the answer says nothing of existence."""
    kinds = set(SCOPED.findall(template))
    theirs = {name: world["theirs"][name] for name in kinds}
    missing = dict.fromkeys(kinds, MISSING)
    other = _call(client, method, template, theirs, world["lyon"])
    unknown = _call(client, method, template, missing, world["lyon"])
    (asked,) = {world["theirs"][name] for name in kinds}  # each route names one study or one round
    expected = "not_a_participant" if SITE <= ROUTES[(method, template)].roles else "forbidden"
    assert (other.status_code, other.json()["error"]["code"]) == (403, expected), other.text
    assert _shape(unknown, MISSING) == _shape(other, asked), (unknown.text, other.text)
    assert str(MISSING) in unknown.json()["error"]["message"] or expected == "forbidden"
    assert "not found" not in unknown.text.lower() and "does not exist" not in unknown.text.lower()


def test_people_still_get_404_for_a_study_that_does_not_exist(client: TestClient, world: dict[str, Any]) -> None:
    for template in ("/api/v1/studies/{}/models/0", "/api/v1/studies/{}/models/0/local", "/api/v1/studies/{}"):
        answer = client.get(template.format(MISSING), headers=ADMIN)
        assert (answer.status_code, answer.json()["error"]["code"]) == (404, "not_found"), (template, answer.text)
        refused = client.get(template.format(MISSING), headers=world["lyon"])
        assert refused.status_code == 403, (template, refused.text)


def test_a_site_asking_for_a_missing_model_of_its_own_study_is_told_404(
    client: TestClient, world: dict[str, Any]
) -> None:
    """Within its own study a site may learn which models exist: it is part of it."""
    own = world["ours"]["study_id"]
    assert client.get(f"/api/v1/studies/{own}/models/0", headers=world["lyon"]).status_code == 200
    missing = client.get(f"/api/v1/studies/{own}/models/7", headers=world["lyon"])
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")


def test_an_upload_of_a_site_not_selected_is_refused_before_its_body_is_spooled(
    client: TestClient, world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    spooled: list[str] = []
    spool = deps._spool

    async def recording(request: Any, into: Any, limit: int) -> None:
        spooled.append(request.url.path)
        await spool(request, into, limit)

    monkeypatch.setattr(deps, "_spool", recording)
    body = b"\0" * (1 << 20)
    for round_id in (world["theirs"]["round_id"], MISSING):
        url = f"/api/v1/rounds/{round_id}/updates"
        answer = client.post(url, content=body, headers={**world["lyon"], **OCTETS})
        assert (answer.status_code, answer.json()["error"]["code"]) == (403, "not_a_participant"), answer.text
    assert spooled == []
    own = f"/api/v1/rounds/{world['ours']['round_id']}/updates"
    answer = client.post(own, content=body, headers={**world["lyon"], **OCTETS})
    assert answer.status_code == 422 and spooled == [own]  # a participant's body is read, and refused as no update


def _post_streamed(client: TestClient, url: str, headers: dict[str, str], chunks: int) -> tuple[int, int]:
    """(status, how many 1 MiB chunks the app pulled) of a POST whose body is produced only as the app reads it."""
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(chunks):
            pulled += 1
            yield b"\0" * (1 << 20)

    async def post() -> int:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            response = await http.post(url, content=body(), headers={**headers, **OCTETS})
        return response.status_code

    status = anyio.run(post)
    return status, pulled


def test_a_large_upload_of_a_site_not_selected_is_not_read_at_all(client: TestClient, world: dict[str, Any]) -> None:
    for round_id in (world["theirs"]["round_id"], MISSING):
        status, pulled = _post_streamed(client, f"/api/v1/rounds/{round_id}/updates", world["lyon"], chunks=256)
        assert (status, pulled) == (403, 0)
    own = f"/api/v1/rounds/{world['ours']['round_id']}/updates"
    assert _post_streamed(client, own, world["lyon"], chunks=3) == (422, 3)  # the instrument sees a body read
