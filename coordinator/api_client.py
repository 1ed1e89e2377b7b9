"""A typed client of the coordinator's researcher and admin endpoints (the CLI and the demo use it)."""

from __future__ import annotations

import os
import ssl
from typing import Any

import httpx

from shared.tls import client_ssl_context
from shared.wire.protocol import ErrorBody

__all__ = ["ApiError", "CoordinatorApi", "tls_from_env"]

# TLS of people's commands (the sites' agents have their own settings): the coordinator's CA, and
# under mutual TLS the person's client certificate (`cardiofl coordinator tls client NAME`).
CA_BUNDLE_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV = "CARDIOFL_CA_BUNDLE", "CARDIOFL_CLIENT_CERT", "CARDIOFL_CLIENT_KEY"


def tls_from_env() -> ssl.SSLContext | bool:
    """The TLS context CARDIOFL_CA_BUNDLE and CARDIOFL_CLIENT_CERT / _KEY ask for, or True (the default trust)."""
    ca_bundle, cert, key = (os.environ.get(name) or None for name in (CA_BUNDLE_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV))
    if ca_bundle is None and cert is None:
        return True
    if (cert is None) != (key is None):
        raise ApiError(f"set both {CLIENT_CERT_ENV} and {CLIENT_KEY_ENV}, or neither")
    try:
        return client_ssl_context(ca_bundle, cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ApiError(f"the TLS files in {CA_BUNDLE_ENV} / {CLIENT_CERT_ENV} / {CLIENT_KEY_ENV}: {exc}") from None


class ApiError(Exception):
    """The coordinator refused a request, or could not be reached; the message is one readable line."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class CoordinatorApi:
    """Researcher and admin calls over an injected httpx client (a TestClient works too)."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    @classmethod
    def connect(
        cls, url: str, token: str | None, *, verify: bool | str | ssl.SSLContext = True, timeout: float = 60.0
    ) -> CoordinatorApi:
        """A client for the coordinator at `url` with a bearer token."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return cls(httpx.Client(base_url=url.rstrip("/"), headers=headers, verify=verify, timeout=timeout))

    def close(self) -> None:
        """Close the underlying connections."""
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(f"cannot reach the coordinator at {self.http.base_url}: {exc}") from None
        if response.status_code >= 400:
            try:
                info = ErrorBody.model_validate_json(response.content).error
                code, message = info.code, info.message
            except ValueError:
                code, message = "http_error", response.text[:200] or response.reason_phrase
            raise ApiError(f"{response.status_code} {code}: {message}", status=response.status_code, code=code)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        return response.json() if response.content else None

    # studies ----------------------------------------------------------------------------------

    def create_study(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """POST /studies."""
        return self._json("POST", "/api/v1/studies", json={"name": name, "config": config})

    def study_action(self, study_id: int, action: str) -> dict[str, Any]:
        """POST /studies/{id}/start|pause|resume|cancel."""
        return self._json("POST", f"/api/v1/studies/{study_id}/{action}")

    def studies(self) -> list[dict[str, Any]]:
        """GET /studies."""
        return self._json("GET", "/api/v1/studies")["data"]

    def study(self, study_id: int) -> dict[str, Any]:
        """GET /studies/{id}."""
        return self._json("GET", f"/api/v1/studies/{study_id}")

    def rounds(self, study_id: int) -> list[dict[str, Any]]:
        """GET /studies/{id}/rounds: every round attempt with per-site and pooled summaries."""
        return self._json("GET", f"/api/v1/studies/{study_id}/rounds")["data"]

    def global_models(self, study_id: int) -> list[dict[str, Any]]:
        """GET /studies/{id}/models."""
        return self._json("GET", f"/api/v1/studies/{study_id}/models")["data"]

    def download_global_model(self, study_id: int, round_number: int) -> bytes:
        """theta^g of a round as safetensors bytes."""
        return self._request("GET", f"/api/v1/studies/{study_id}/models/{round_number}").content

    # sites and tokens -------------------------------------------------------------------------

    def enrol_site(self, name: str) -> dict[str, Any]:
        """POST /sites: the site and its token (shown once)."""
        return self._json("POST", "/api/v1/sites", json={"name": name})

    def sites(self) -> list[dict[str, Any]]:
        """GET /sites."""
        return self._json("GET", "/api/v1/sites")["data"]

    def rotate_site_token(self, name: str) -> dict[str, Any]:
        """POST /sites/{name}/token: a new token; every older token of the site is revoked at once."""
        return self._json("POST", f"/api/v1/sites/{name}/token")

    def create_token(self, role: str, label: str = "") -> dict[str, Any]:
        """POST /tokens."""
        return self._json("POST", "/api/v1/tokens", json={"role": role, "label": label})

    def tokens(self) -> list[dict[str, Any]]:
        """GET /tokens."""
        return self._json("GET", "/api/v1/tokens")["data"]

    def revoke_token(self, token_id: int) -> None:
        """DELETE /tokens/{id}."""
        self._request("DELETE", f"/api/v1/tokens/{token_id}")

    def status(self) -> dict[str, Any]:
        """GET /status."""
        return self._json("GET", "/api/v1/status")
