"""A site not selected for a round learns nothing from the secure-round routes: 403 before the round or the body.

Tests taking `client` run on SQLite and on PostgreSQL (tests/coordinator/conftest.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from fastapi.testclient import TestClient
from httpx import Response

from tests.coordinator.factories import ADMIN, approve, create_study, enrol

SECURE = {"min_sites": 2, "privacy": {"min_records": 1, "secure_aggregation": {"phase_timeout_s": 30}}}
SECAGG = "/api/v1/rounds/{round_id}/secagg"
# Bodies no secure-round message is: each would be a 422 naming the message's fields to a site that may post it.
INVALID_BODIES: list[dict[str, Any]] = [
    {},
    {"json": {}},
    {"json": {"shares": "none", "num_examples": -1, "cipher_public": 7}},
    {"json": [1, 2, 3]},
    {"content": b"\xff\xfe not utf-8", "headers": {"Content-Type": "application/octet-stream"}},
]


def secagg_posts(client: TestClient) -> list[str]:
    """The path templates of every secure-round message a site posts (whatever the protocol's phases are)."""
    paths = client.app.openapi()["paths"]
    return sorted(path for path, operations in paths.items() if path.startswith(SECAGG + "/") and "post" in operations)


def first_round(client: TestClient, sites: tuple[str, str], *, secure: bool) -> tuple[int, dict[str, dict[str, str]]]:
    """(the first round's id, each site's headers) of a running study of `sites`, secure or plain."""
    headers = {name: enrol(client, name) for name in sites}
    for site_headers in headers.values():  # a secure study's sites each registered their signing key
        public = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        response = client.put("/api/v1/sites/me/signing-key", json={"public_key": public.hex()}, headers=site_headers)
        assert response.status_code == 204, response.text
    study_id = create_study(client, list(sites), **(SECURE if secure else {}))
    for site_headers in headers.values():
        approve(client, site_headers, study_id)
    assert client.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    (round_,) = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert set(round_["participants"]) == set(sites)
    return round_["id"], headers


def refused(response: Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
def test_a_site_not_selected_gets_403_before_anything_about_the_round_or_its_body(
    client: TestClient, secure: bool
) -> None:
    round_id, _ = first_round(client, ("lyon", "oslo"), secure=secure)
    outsider = enrol(client, "graz")
    posts = secagg_posts(client)
    assert {"/advertisement", "/shares", "/reveal"} <= {path.removeprefix(SECAGG) for path in posts}
    url = SECAGG.format(round_id=round_id)
    for params in ({}, {"wait": 5}, {"wait": "soon"}):  # an invalid query is not looked at either
        answer = client.get(url, params=params, headers=outsider)
        assert refused(answer) == (403, "not_a_participant"), (params, answer.text)
        assert "secure" not in answer.text
    for template in posts:
        for body in INVALID_BODIES:
            headers = {**outsider, **body.get("headers", {})}
            answer = client.post(template.format(round_id=round_id), **{**body, "headers": headers})
            assert refused(answer) == (403, "not_a_participant"), (template, body, answer.text)


def test_a_body_that_is_not_json_is_refused_alike_whatever_the_round(client: TestClient) -> None:
    """FastAPI parses JSON before any dependency (even the token's): the answer says nothing of the round."""
    rounds = [first_round(client, (f"a{i}", f"b{i}"), secure=secure)[0] for i, secure in enumerate((False, True))]
    outsider = enrol(client, "graz")
    answers = set()
    for round_id in [*rounds, 999_999]:
        for template in secagg_posts(client):
            headers = {**outsider, "Content-Type": "application/json"}
            answer = client.post(template.format(round_id=round_id), content=b"{not json", headers=headers)
            assert refused(answer) == (422, "invalid_request"), answer.text
            answers.add(answer.text)
    assert len(answers) == 1 and "JSON" in answers.pop()


def test_participants_get_their_own_answers_and_unknown_rounds_the_outsiders(client: TestClient) -> None:
    plain, plain_sites = first_round(client, ("lyon", "oslo"), secure=False)
    secure, secure_sites = first_round(client, ("rome", "kiel"), secure=True)
    lyon, rome = plain_sites["lyon"], secure_sites["rome"]
    assert refused(client.get(SECAGG.format(round_id=plain), headers=lyon)) == (409, "not_a_secure_round")
    told = client.post(SECAGG.format(round_id=plain) + "/advertisement", json={}, headers=lyon)
    assert refused(told) == (422, "invalid_request") and "cipher_public" in told.text  # it may post: it is told
    seen = client.get(SECAGG.format(round_id=secure), headers=rome)
    assert seen.status_code == 200 and seen.json()["round_id"] == secure
    assert refused(client.get(SECAGG.format(round_id=secure), headers=lyon)) == (403, "not_a_participant")
    assert refused(client.get(SECAGG.format(round_id=plain), headers=rome)) == (403, "not_a_participant")
    for round_id in (999_999, 0):  # a site learns no round's existence: 403 as for a round of others
        for method, path in (("GET", ""), ("POST", "/advertisement")):
            answer = client.request(method, SECAGG.format(round_id=round_id) + path, headers=lyon)
            assert refused(answer) == (403, "not_a_participant"), answer.text
