"""`CardioflClient`: the coordinator's researcher and admin endpoints, each answer as its wire model.

The models are those the coordinator's routes declare (shared/wire/api.py), so a caller, the
`cardiofl` commands and the coordinator share one schema. Nothing here imports torch: a notebook or a
script can drive studies with pydantic and httpx alone.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar, overload

import httpx
from pydantic import BaseModel

from shared.tls import client_ssl_context
from shared.wire.api import (
    AuditEventPublic,
    GlobalModelPublic,
    ModelUploaded,
    Page,
    RoundPublic,
    SiteEnrolled,
    SitePublic,
    StatusReport,
    StudyPublic,
    TokenIssued,
    TokenPublic,
)
from shared.wire.card import ModelCard
from shared.wire.jobs import EvaluationResults, ExternalResults, SurveyResults
from shared.wire.protocol import ErrorBody
from shared.wire.urls import API, global_model_url, initial_local_url

__all__ = ["ApiError", "CardioflClient", "StudyAction", "refusal", "tls_from_env", "unreachable"]

# TLS of people's commands (the sites' agents have their own settings): the coordinator's CA, and
# under mutual TLS the person's client certificate (`cardiofl coordinator tls client NAME`).
CA_BUNDLE_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV = "CARDIOFL_CA_BUNDLE", "CARDIOFL_CLIENT_CERT", "CARDIOFL_CLIENT_KEY"

StudyAction = Literal["start", "pause", "resume", "cancel"]
SETTLED = frozenset({"completed", "failed", "cancelled"})  # a round attempt that changes no more
ENDED = frozenset({"completed", "failed", "cancelled"})  # a study that settles no more rounds
M = TypeVar("M", bound=BaseModel)


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


def unreachable(url: httpx.URL, error: httpx.TransportError) -> str:
    """One line on why the coordinator at `url` did not answer, naming the fix when it is a known one."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None or "CERTIFICATE_VERIFY_FAILED" in str(error):
        ca_bundle = os.environ.get(CA_BUNDLE_ENV)
        trusted = f"the CA in {CA_BUNDLE_ENV} ({ca_bundle})" if ca_bundle else "this machine's default CAs"
        detail = cause.verify_message if isinstance(cause, ssl.SSLCertVerificationError) else "not trusted"
        return (
            f"the coordinator at {url} has a TLS certificate not signed by {trusted} (CERTIFICATE_VERIFY_FAILED: "
            f"{detail}): set {CA_BUNDLE_ENV} to the coordinator's CA certificate (its kit's ca.pem)"
        )
    if isinstance(error, httpx.RemoteProtocolError | httpx.ReadError) and url.scheme == "http":  # dropped or reset
        https = url.copy_with(scheme="https")
        return (
            f"the coordinator at {url} closed the connection without answering ({error}): it may speak https: "
            f"use {str(https).rstrip('/')} (--url or CARDIOFL_URL)"
        )
    return f"cannot reach the coordinator at {url}: {error}"


class ApiError(Exception):
    """The coordinator refused a request, or could not be reached; the message is one readable line.

    `status` is the HTTP status and `code` the coordinator's error code (None when nothing answered).
    """

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def refusal(response: httpx.Response) -> ApiError:
    """The ApiError of an answer of status 400 or above (its body read), from the coordinator's error body."""
    try:
        info = ErrorBody.model_validate_json(response.content).error
        code, message = info.code, info.message
    except ValueError:
        code, message = "http_error", response.text[:200] or response.reason_phrase
    return ApiError(f"{response.status_code} {code}: {message}", status=response.status_code, code=code)


class CardioflClient:
    """Researcher and admin calls over an injected httpx client (a fastapi TestClient works too)."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    @classmethod
    def connect(
        cls, url: str, token: str | None, *, verify: bool | str | ssl.SSLContext = True, timeout: float = 60.0
    ) -> CardioflClient:
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
            raise ApiError(unreachable(self.http.base_url, exc)) from None
        if response.status_code >= 400:
            raise refusal(response)
        return response

    def _one(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        return model.model_validate_json(self._request(method, path, **kwargs).content)

    def _page(self, model: type[M], path: str) -> list[M]:
        """The items of a list endpoint, which answers `{"data": [...], "count": n}`."""
        return Page[model].model_validate_json(self._request("GET", path).content).data  # type: ignore[valid-type]

    # studies ----------------------------------------------------------------------------------

    def create_study(self, name: str, config: Mapping[str, Any]) -> StudyPublic:
        """POST /studies: a draft study from its name and config (the terms of shared/terms/study_terms.py as JSON)."""
        return self._one(StudyPublic, "POST", f"{API}/studies", json={"name": name, "config": dict(config)})

    def study_action(self, study_id: int, action: StudyAction) -> StudyPublic:
        """POST /studies/{id}/start|pause|resume|cancel: the study after the change."""
        return self._one(StudyPublic, "POST", f"{API}/studies/{study_id}/{action}")

    def studies(self) -> list[StudyPublic]:
        """GET /studies."""
        return self._page(StudyPublic, f"{API}/studies")

    def study(self, study_id: int) -> StudyPublic:
        """GET /studies/{id}."""
        return self._one(StudyPublic, "GET", f"{API}/studies/{study_id}")

    def rounds(self, study_id: int) -> list[RoundPublic]:
        """GET /studies/{id}/rounds: every round attempt with per-site and pooled summaries."""
        return self._page(RoundPublic, f"{API}/studies/{study_id}/rounds")

    def watch_rounds(self, study_id: int, *, wait: float = 30.0) -> Iterator[RoundPublic]:
        """Each round attempt as it settles (completed, failed or cancelled), oldest first, until the study ends.

        A long-poll: GET /studies/{id}/rounds?settled=n&wait= answers once more than n attempts have
        settled, so a quiet study costs one request per `wait` seconds (the server caps it at its
        max_poll_wait_s, 30 s by default, below `connect`'s timeout), not a request a second. A
        round's pooled Global reading arrives later, with the next round's sites.
        """
        shown: set[int] = set()
        while True:
            ended = self.study(study_id).status in ENDED  # read first: the rounds read after it are then final
            params = {"settled": len(shown), "wait": 0.0 if ended else wait}
            path = f"{API}/studies/{study_id}/rounds"
            answer = self._request("GET", path, params=params)  # the client's timeout (60 s) outlasts the wait
            for round_ in Page[RoundPublic].model_validate_json(answer.content).data:
                if round_.status in SETTLED and round_.id not in shown:
                    shown.add(round_.id)
                    yield round_
            if ended:
                return

    def round(self, study_id: int, number: int) -> RoundPublic:
        """GET /studies/{id}/rounds/{t}: the latest attempt of round t."""
        return self._one(RoundPublic, "GET", f"{API}/studies/{study_id}/rounds/{number}")

    def audit(self, study_id: int) -> list[AuditEventPublic]:
        """GET /studies/{id}/audit: the study's audit events."""
        return self._page(AuditEventPublic, f"{API}/studies/{study_id}/audit")

    def survey(self, study_id: int) -> SurveyResults:
        """GET /studies/{id}/survey: a survey study's released surveys, site by site, and the sites awaited."""
        return self._one(SurveyResults, "GET", f"{API}/studies/{study_id}/survey")

    def external(self, study_id: int) -> ExternalResults:
        """GET /studies/{id}/external: the validation sites' evaluations of released theta^g_t, by round and site."""
        return self._one(ExternalResults, "GET", f"{API}/studies/{study_id}/external")

    def evaluations(self, study_id: int) -> EvaluationResults:
        """GET /studies/{id}/evaluations: an evaluate study's per-site results, as released and adapted."""
        return self._one(EvaluationResults, "GET", f"{API}/studies/{study_id}/evaluations")

    @overload
    def card(
        self, study_id: int, format: Literal["json"] = "json", *, baseline: int | None = None, survey: int | None = None
    ) -> ModelCard: ...

    @overload
    def card(
        self, study_id: int, format: Literal["md", "html"], *, baseline: int | None = None, survey: int | None = None
    ) -> str: ...

    def card(
        self, study_id: int, format: str = "json", *, baseline: int | None = None, survey: int | None = None
    ) -> ModelCard | str:
        """GET /studies/{id}/card: the study's model card (a ModelCard), or its Markdown or HTML text.

        `baseline` names a study of algorithm `local` on the same sites to compare each site's figures with;
        `survey` a survey study of its sites for the card's Data section (default: the coordinator picks one).
        """
        params: dict[str, str | int] = {"format": format}
        if baseline is not None:
            params["baseline"] = baseline
        if survey is not None:
            params["survey"] = survey
        answer = self._request("GET", f"{API}/studies/{study_id}/card", params=params)
        return ModelCard.model_validate_json(answer.content) if format == "json" else answer.text

    def global_models(self, study_id: int) -> list[GlobalModelPublic]:
        """GET /studies/{id}/models: the stored global models theta^g_t."""
        return self._page(GlobalModelPublic, f"{API}/studies/{study_id}/models")

    def download_global_model(self, study_id: int, round_number: int) -> bytes:
        """theta^g of a round as safetensors bytes."""
        return self._request("GET", global_model_url(study_id, round_number)).content

    def upload_model(self, data: bytes) -> str:
        """POST /models: a model file's safetensors bytes stored at the coordinator; their sha256, which terms name."""
        headers = {"Content-Type": "application/octet-stream"}
        return self._one(ModelUploaded, "POST", f"{API}/models", content=data, headers=headers).sha256

    def download_initial_local(self, study_id: int) -> bytes:
        """phi_0, the initial local tensors of a study, as safetensors bytes."""
        return self._request("GET", initial_local_url(study_id)).content

    # sites and tokens -------------------------------------------------------------------------

    def enrol_site(self, name: str) -> SiteEnrolled:
        """POST /sites: the site and its token (shown once)."""
        return self._one(SiteEnrolled, "POST", f"{API}/sites", json={"name": name})

    def sites(self) -> list[SitePublic]:
        """GET /sites."""
        return self._page(SitePublic, f"{API}/sites")

    def rotate_site_token(self, name: str) -> TokenIssued:
        """POST /sites/{name}/token: a new token; every older token of the site is revoked at once."""
        return self._one(TokenIssued, "POST", f"{API}/sites/{name}/token")

    def create_token(self, role: str, label: str = "") -> TokenIssued:
        """POST /tokens: an admin, researcher or viewer token (its secret is in this answer only)."""
        return self._one(TokenIssued, "POST", f"{API}/tokens", json={"role": role, "label": label})

    def tokens(self) -> list[TokenPublic]:
        """GET /tokens (never their secrets)."""
        return self._page(TokenPublic, f"{API}/tokens")

    def revoke_token(self, token_id: int) -> None:
        """DELETE /tokens/{id}."""
        self._request("DELETE", f"{API}/tokens/{token_id}")

    def status(self) -> StatusReport:
        """GET /status: studies, round counts by status, sites."""
        return self._one(StatusReport, "GET", f"{API}/status")
