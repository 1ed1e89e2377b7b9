from fastapi.testclient import TestClient

from tests.coordinator.factories import ADMIN, bearer, enrol, site_headers


def test_enrol_site_returns_its_token_once(client: TestClient) -> None:
    response = client.post("/api/v1/sites", json={"name": "lyon"}, headers=ADMIN)
    assert response.status_code == 201
    body = response.json()
    assert body["site"]["name"] == "lyon" and body["site"]["last_seen_at"] is None
    assert body["token"]["role"] == "site" and body["token"]["token"].startswith("cfl_")
    me = client.get("/api/v1/sites/me", headers=site_headers(body["token"]["token"])).json()
    assert me["name"] == "lyon" and me["last_seen_at"] is not None


def test_enrolling_a_name_twice_conflicts(client: TestClient) -> None:
    enrol(client, "lyon")
    response = client.post("/api/v1/sites", json={"name": "lyon"}, headers=ADMIN)
    assert response.status_code == 409 and response.json()["error"]["code"] == "already_exists"
    assert client.get("/api/v1/sites", headers=ADMIN).json()["count"] == 1


def test_site_names_are_validated(client: TestClient) -> None:
    response = client.post("/api/v1/sites", json={"name": "Not A Name!"}, headers=ADMIN)
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"


def test_list_sites_in_name_order(client: TestClient) -> None:
    for name in ("oslo", "graz", "lyon"):
        enrol(client, name)
    listed = client.get("/api/v1/sites", headers=ADMIN).json()
    assert listed["count"] == 3 and [s["name"] for s in listed["data"]] == ["graz", "lyon", "oslo"]


def test_create_researcher_token_and_use_it(client: TestClient) -> None:
    response = client.post("/api/v1/tokens", json={"role": "researcher", "label": "ana"}, headers=ADMIN)
    assert response.status_code == 201
    issued = response.json()
    me = client.get("/api/v1/tokens/me", headers=bearer(issued["token"])).json()
    assert me == {"role": "researcher", "actor": f"token:{issued['id']}", "token_id": issued["id"], "site": None}


def test_site_tokens_cannot_be_created_directly(client: TestClient) -> None:
    response = client.post("/api/v1/tokens", json={"role": "site"}, headers=ADMIN)
    assert response.status_code == 422


def test_revoking_an_unknown_token_is_not_found(client: TestClient) -> None:
    response = client.delete("/api/v1/tokens/4242", headers=ADMIN)
    assert response.status_code == 404


def test_rotating_an_unknown_site_is_not_found(client: TestClient) -> None:
    assert client.post("/api/v1/sites/ghost/token", headers=ADMIN).status_code == 404


def test_revoked_token_is_listed_with_its_revocation_time(client: TestClient) -> None:
    issued = client.post("/api/v1/tokens", json={"role": "viewer"}, headers=ADMIN).json()
    client.delete(f"/api/v1/tokens/{issued['id']}", headers=ADMIN)
    client.delete(f"/api/v1/tokens/{issued['id']}", headers=ADMIN)  # revoking twice changes nothing
    listed = {t["id"]: t for t in client.get("/api/v1/tokens", headers=ADMIN).json()["data"]}
    assert listed[issued["id"]]["revoked_at"] is not None
