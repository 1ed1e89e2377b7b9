import hashlib
import re
import threading

import fastapi.routing
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from httpx import Response
from sqlalchemy import select, update

from coordinator.api.roles import NO_TOKEN, ROUTES
from coordinator.main import create_app
from coordinator.models import Role, Site, Token
from shared.wire.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_HEADER
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, OCTETS, bearer, enrol, issue, next_task, running_study, site_headers

# The value of each path parameter: reads see the running study; changes aim at absent targets
# (or at the study's open round, with an empty body) so that an admitted call answers 404 or 422
# and the walk's own tokens and study survive it.
READS = {"study_id": "{study}", "number": "0", "round_id": "{round}", "sha256": "0" * 64}
CHANGES = {
    "study_id": "9999",
    "name": "nowhere",
    "token_id": "9999",
    "round_id": "{round}",
    "kind": "survey",
    "number": "0",
    "sha256": "0" * 64,
}


def served_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path template, as documented: `{token_id:id}` is `{token_id}`) of every route (HEAD is GET's)."""
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)  # FastAPI >= 0.16x nests included routers
    routes = list(flatten(app.routes)) if flatten is not None else app.routes
    return {(method, route.path_format) for route in routes for method in route.methods or () if method != "HEAD"}


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


def _url(method: str, template: str, world: dict) -> str:
    values = READS if method == "GET" else CHANGES
    filled = re.sub(r"\{(\w+)\}", lambda match: values[match.group(1)], template)
    return filled.format(study=world["study"], round=world["round"])


def _call(client: TestClient, method: str, url: str, headers: dict[str, str]) -> Response:
    body = b"" if method in ("POST", "PUT", "PATCH") else None  # a missing body: 422 once admitted
    return client.request(method, url, content=body, headers={**headers, **OCTETS} if body is not None else headers)


def test_the_table_of_roles_names_every_route_and_no_other(client: TestClient) -> None:
    served = served_routes(client.app)
    assert len(served) >= 30
    assert served - set(ROUTES) == set(), "routes without an entry in coordinator/api/roles.py"
    assert set(ROUTES) - served == set(), "entries for routes that do not exist"


@pytest.mark.parametrize(("method", "template"), sorted(ROUTES), ids=[f"{m} {t}" for m, t in sorted(ROUTES)])
def test_every_route_admits_exactly_its_roles(client: TestClient, world: dict, method: str, template: str) -> None:
    allowed = ROUTES[(method, template)].roles
    url = _url(method, template, world)
    documented = client.app.openapi()["paths"].get(template, {}).get(method.lower(), {}).get("responses")
    callers = {role.value: world["headers"][role.value] for role in Role} | {"no token": {}, "forged": bearer("cfl_x")}
    for caller, headers in callers.items():
        response = _call(client, method, url, headers)
        admitted = allowed == NO_TOKEN or caller in {role.value for role in allowed}
        assert response.status_code < 500, (caller, response.text)
        assert documented is None or str(response.status_code) in documented, (caller, response.status_code)
        if admitted:
            assert response.status_code not in (401, 403), (caller, response.text)
        elif caller in ("no token", "forged"):
            assert response.status_code == 401 and response.json()["error"]["code"] == "unauthenticated"
            assert response.headers["www-authenticate"] == "Bearer"
        else:
            assert response.status_code == 403, (caller, response.text)
            assert response.json()["error"]["code"] == "forbidden"


def test_a_viewer_may_not_list_a_studys_models(client: TestClient, world: dict) -> None:
    response = client.get(f"/api/v1/studies/{world['study']}/models", headers=world["headers"]["viewer"])
    assert response.status_code == 403 and "needs admin, researcher" in response.json()["error"]["message"]


def test_health_and_openapi_need_no_token(client: TestClient) -> None:
    from importlib.metadata import version

    from shared.wire.protocol import PROTOCOL_VERSION

    release = version("cardiofl")
    health = client.get("/api/v1/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "version": release, "protocol": PROTOCOL_VERSION, "database": "ok"}
    assert client.get("/docs").status_code == 200
    document = client.get("/openapi.json").json()
    assert document["info"]["version"] == release  # the package's, not a constant
    assert "/api/v1/rounds/{round_id}/updates" in document["paths"] and "/api/v1/tasks/next" in document["paths"]


def test_health_says_503_naming_the_database_when_it_does_not_answer(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import create_engine

    state = client.app.state.coordinator  # type: ignore[attr-defined]
    gone = create_engine("postgresql+psycopg://nobody@127.0.0.1:9/none", connect_args={"connect_timeout": 2})
    monkeypatch.setattr(state, "engine", gone)
    health = client.get("/api/v1/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "database_unavailable"
    assert "the database does not answer" in health.json()["error"]["message"]


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
    new = site_headers(response.json()["token"])
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


@pytest.mark.parametrize(
    ("sent", "admitted"),
    [
        (None, False),  # cardiofl 0.1's agents send no version: protocol 1
        ("1", False),
        (str(MIN_PROTOCOL_VERSION - 1), False),
        ("", False),
        ("two", False),
        (b"\xb2", False),  # latin-1 '²': a digit to str.isdigit, not to int()
        ("9" * 40, False),
        (str(MIN_PROTOCOL_VERSION), True),
        (str(MIN_PROTOCOL_VERSION + 5), True),  # a newer agent declines what it cannot do itself
    ],
)
def test_site_agents_of_a_protocol_the_coordinator_no_longer_serves_are_told_to_upgrade(
    client: TestClient, sent: str | bytes | None, admitted: bool
) -> None:
    study_id, headers = running_study(client)
    token = headers["oslo"]["Authorization"]
    sent_headers = {"Authorization": token} | ({PROTOCOL_HEADER: sent} if sent is not None else {})
    for method, path in [("GET", "/api/v1/tasks/next"), ("GET", "/api/v1/sites/me"), ("GET", "/api/v1/tokens/me")]:
        response = client.request(method, path, headers=sent_headers)
        if admitted:
            assert response.status_code == 200, response.text
            continue
        assert response.status_code == 426, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "agent_too_old" and "upgrade the site agent" in error["message"]
    # people's tokens never send a version: only site agents are asked for one
    assert client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).status_code == 200


def test_the_headers_of_a_site_agent_of_this_release_are_admitted(client: TestClient) -> None:
    _, headers = running_study(client)
    token = headers["oslo"]["Authorization"].removeprefix("Bearer ")
    assert client.get("/api/v1/sites/me", headers=site_headers(token)).json()["name"] == "oslo"
