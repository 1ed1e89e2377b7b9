import hashlib
import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from coordinator.main import create_app
from coordinator.models import Site, Token
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, OCTETS, bearer, enrol, issue, next_task, running_study

ALL = {"admin", "researcher", "viewer", "site", "other_site"}
PEOPLE = {"admin", "researcher", "viewer"}
RUNNERS = {"admin", "researcher"}
SITES = {"site", "other_site"}

# (method, path, body, roles allowed); {study} and {round} are filled in. Mutations aim at absent
# targets (id 9999) so that an allowed call answers 404 and the matrix's own tokens survive.
ENDPOINTS = [
    ("POST", "/api/v1/sites", {"name": "newsite"}, {"admin"}),
    ("GET", "/api/v1/sites", None, PEOPLE),
    ("GET", "/api/v1/sites/me", None, SITES),
    ("POST", "/api/v1/sites/nowhere/token", None, {"admin"}),
    ("POST", "/api/v1/tokens", {"role": "viewer"}, {"admin"}),
    ("GET", "/api/v1/tokens", None, {"admin"}),
    ("DELETE", "/api/v1/tokens/9999", None, {"admin"}),
    ("GET", "/api/v1/tokens/me", None, ALL),
    ("POST", "/api/v1/studies", {"name": "x", "config": {"sites": ["nowhere"]}}, RUNNERS),
    ("GET", "/api/v1/studies", None, PEOPLE),
    ("GET", "/api/v1/studies/{study}", None, PEOPLE),
    ("POST", "/api/v1/studies/9999/start", None, RUNNERS),
    ("POST", "/api/v1/studies/9999/pause", None, RUNNERS),
    ("POST", "/api/v1/studies/9999/resume", None, RUNNERS),
    ("POST", "/api/v1/studies/9999/cancel", None, RUNNERS),
    ("GET", "/api/v1/studies/{study}/rounds", None, PEOPLE),
    ("GET", "/api/v1/studies/{study}/rounds/1", None, PEOPLE),
    ("GET", "/api/v1/studies/{study}/audit", None, RUNNERS),
    ("GET", "/api/v1/studies/{study}/models", None, PEOPLE | {"site"}),  # viewers list, never download
    ("GET", "/api/v1/studies/{study}/models/0", None, RUNNERS | {"site"}),
    ("GET", "/api/v1/studies/{study}/models/0/local", None, RUNNERS | {"site"}),
    ("GET", "/api/v1/tasks/next", None, SITES),
    ("POST", "/api/v1/rounds/{round}/updates", b"", {"site"}),  # the other site is not a participant
    ("GET", "/api/v1/status", None, PEOPLE),
]


@pytest.fixture()
def world(client: TestClient) -> dict:
    study_id, headers = running_study(client, sites=("lyon",))
    return {
        "study": study_id,
        "round": next_task(client, headers["lyon"])["round_id"],
        "headers": {
            "admin": issue(client, "admin"),
            "researcher": issue(client, "researcher"),
            "viewer": issue(client, "viewer"),
            "site": headers["lyon"],
            "other_site": enrol(client, "graz"),
        },
    }


def _call(client: TestClient, method: str, path: str, body: object, headers: dict[str, str]):
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={**headers, **OCTETS})
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path", "body", "allowed"), ENDPOINTS, ids=[f"{m} {p}" for m, p, *_ in ENDPOINTS])
def test_auth_matrix(client: TestClient, world: dict, method: str, path: str, body: object, allowed: set) -> None:
    url = path.format(study=world["study"], round=world["round"])
    anonymous = _call(client, method, url, body, {})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "unauthenticated"
    assert anonymous.headers["www-authenticate"] == "Bearer"
    forged = _call(client, method, url, body, bearer("cfl_forged"))
    assert forged.status_code == 401
    for role, headers in world["headers"].items():
        response = _call(client, method, url, body, headers)
        if role in allowed:
            assert response.status_code not in (401, 403), (role, response.text)
        else:
            assert response.status_code == 403, (role, response.text)
            assert response.json()["error"]["code"] in ("forbidden", "not_a_participant")


def test_health_and_openapi_need_no_token(client: TestClient) -> None:
    assert client.get("/api/v1/health").json() == {"status": "ok"}
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert "/api/v1/rounds/{round_id}/updates" in paths and "/api/v1/tasks/next" in paths


def test_site_downloads_only_its_own_studies(client: TestClient, world: dict) -> None:
    url = f"/api/v1/studies/{world['study']}/models/0"
    response = client.get(url, headers=world["headers"]["other_site"])
    assert response.status_code == 403 and "not enrolled" in response.json()["error"]["message"]


def test_site_sees_only_its_own_tasks(client: TestClient, world: dict) -> None:
    assert client.get("/api/v1/tasks/next", headers=world["headers"]["other_site"]).status_code == 204
    assert next_task(client, world["headers"]["site"])["site"] == "lyon"


def test_revocation_is_effective_immediately(client: TestClient, world: dict) -> None:
    headers = world["headers"]["researcher"]
    me = client.get("/api/v1/tokens/me", headers=headers).json()
    assert me["role"] == "researcher"
    assert client.delete(f"/api/v1/tokens/{me['token_id']}", headers=ADMIN).status_code == 204
    refused = client.get("/api/v1/studies", headers=headers)
    assert refused.status_code == 401 and refused.json()["error"]["message"] == "token revoked"


def test_rotating_a_site_token_revokes_the_old_one(client: TestClient, world: dict) -> None:
    old = world["headers"]["site"]
    response = client.post("/api/v1/sites/lyon/token", headers=ADMIN)
    assert response.status_code == 201
    new = bearer(response.json()["token"])
    assert client.get("/api/v1/tasks/next", headers=old).status_code == 401
    assert client.get("/api/v1/sites/me", headers=new).json()["name"] == "lyon"


def test_tokens_are_stored_hashed_and_listed_without_secrets(client: TestClient, world: dict, sessions) -> None:
    secret = world["headers"]["viewer"]["Authorization"].split()[1]
    listing = client.get("/api/v1/tokens", headers=ADMIN)
    assert secret not in listing.text
    with sessions() as session:
        hashes = session.scalars(select(Token.token_hash)).all()
    assert hashlib.sha256(secret.encode()).hexdigest() in hashes and secret not in hashes
    roles = {t["role"] for t in listing.json()["data"]}
    assert roles == {"admin", "researcher", "viewer", "site"}
    sites = {t["site"] for t in listing.json()["data"] if t["role"] == "site"}
    assert sites == {"lyon", "graz"}


@pytest.mark.parametrize("header", ["Basic abc", "Bearer", "Bearer    ", "token"])
def test_malformed_authorization_is_unauthenticated(client: TestClient, header: str) -> None:
    response = client.get("/api/v1/status", headers={"Authorization": header})
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthenticated"


def test_without_bootstrap_token_the_admin_token_is_unknown(database_url: str) -> None:
    with TestClient(create_app(coordinator_settings_for(database_url, admin_token=None))) as client:
        assert client.get("/api/v1/tokens", headers=ADMIN).status_code == 401


def test_a_request_is_not_held_up_by_a_writer_holding_the_lock(client: TestClient) -> None:
    site = enrol(client, "lyon")
    assert client.get("/api/v1/sites/me", headers=site).status_code == 200  # last_seen_at is fresh now
    viewer = issue(client, "viewer")
    writer = client.app.state.coordinator.sessions()
    writer.execute(update(Token).where(Token.id == -1).values(role="viewer"))  # takes the write lock
    try:
        done: dict[str, int] = {}

        def call() -> None:
            done["viewer"] = client.get("/api/v1/tokens/me", headers=viewer).status_code
            done["site"] = client.get("/api/v1/tokens/me", headers=site).status_code

        caller = threading.Thread(target=call)
        caller.start()
        caller.join(timeout=20)
        assert done == {"viewer": 200, "site": 200}, "authentication waited for the writer"
    finally:
        writer.rollback()
        writer.close()


def test_a_sites_last_seen_is_written_when_due(client: TestClient) -> None:
    site = enrol(client, "lyon")
    sessions = client.app.state.coordinator.sessions
    with sessions() as session:
        assert session.scalar(select(Site.last_seen_at).where(Site.name == "lyon")) is None
    assert client.get("/api/v1/tokens/me", headers=site).status_code == 200
    with sessions() as session:
        first = session.scalar(select(Site.last_seen_at).where(Site.name == "lyon"))
    assert first is not None
    client.get("/api/v1/tokens/me", headers=site)  # within the resolution: not written again
    with sessions() as session:
        assert session.scalar(select(Site.last_seen_at).where(Site.name == "lyon")) == first
