"""Who may call each route, in one table: the authorization dependency, the OpenAPI document and the tests read it.

A route of the app's routers that is missing from the table is refused to everyone; the tests walk
every route of the app (FastAPI's own documents included) against it, so a new route cannot ship
without an entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from coordinator.models import Role

__all__ = [
    "ADMIN",
    "ANY_TOKEN",
    "NO_TOKEN",
    "RESEARCHER",
    "ROUTES",
    "SITE",
    "VIEWER",
    "Access",
    "Roles",
    "access_for",
    "role_names",
    "template_pattern",
]

Roles = frozenset[Role]

NO_TOKEN: Roles = frozenset()  # open to every caller, with or without a token
ADMIN: Roles = frozenset({Role.ADMIN})
RESEARCHER: Roles = ADMIN | {Role.RESEARCHER}  # an admin may do all a researcher may do
VIEWER: Roles = RESEARCHER | {Role.VIEWER}  # people who may read studies, rounds and status
SITE: Roles = frozenset({Role.SITE})
ANY_TOKEN: Roles = frozenset(Role)


@dataclass(frozen=True)
class Access:
    """The roles that may call a route, and whether it refuses requests that contradict the current state (409)."""

    roles: Roles
    conflicts: bool = False


API = "/api/v1"

ROUTES: dict[tuple[str, str], Access] = {
    # sites and tokens
    ("POST", f"{API}/sites"): Access(ADMIN, conflicts=True),
    ("GET", f"{API}/sites"): Access(VIEWER),
    ("GET", f"{API}/sites/me"): Access(SITE),
    ("GET", f"{API}/sites/me/studies"): Access(SITE),
    ("PUT", f"{API}/sites/me/signing-key"): Access(SITE, conflicts=True),
    ("PUT", f"{API}/sites/me/studies/{{study_id}}/approval"): Access(SITE, conflicts=True),
    ("POST", f"{API}/sites/{{name}}/token"): Access(ADMIN),
    ("POST", f"{API}/tokens"): Access(ADMIN),
    ("GET", f"{API}/tokens"): Access(ADMIN),
    ("GET", f"{API}/tokens/me"): Access(ANY_TOKEN),
    ("DELETE", f"{API}/tokens/{{token_id}}"): Access(ADMIN),
    # studies and their rounds
    ("POST", f"{API}/studies"): Access(RESEARCHER, conflicts=True),  # 409: a secure study's site lacks its key
    ("GET", f"{API}/studies"): Access(VIEWER),
    ("GET", f"{API}/studies/{{study_id}}"): Access(VIEWER),
    ("POST", f"{API}/studies/{{study_id}}/start"): Access(RESEARCHER, conflicts=True),
    ("POST", f"{API}/studies/{{study_id}}/pause"): Access(RESEARCHER, conflicts=True),
    ("POST", f"{API}/studies/{{study_id}}/resume"): Access(RESEARCHER, conflicts=True),
    ("POST", f"{API}/studies/{{study_id}}/cancel"): Access(RESEARCHER, conflicts=True),
    ("GET", f"{API}/studies/{{study_id}}/rounds"): Access(VIEWER),
    ("GET", f"{API}/studies/{{study_id}}/rounds/{{number}}"): Access(VIEWER),
    ("GET", f"{API}/studies/{{study_id}}/card"): Access(VIEWER),
    ("GET", f"{API}/studies/{{study_id}}/audit"): Access(RESEARCHER),
    # what sites reported of their jobs outside rounds; 409: a study of another kind
    ("GET", f"{API}/studies/{{study_id}}/survey"): Access(VIEWER, conflicts=True),
    ("GET", f"{API}/studies/{{study_id}}/external"): Access(VIEWER, conflicts=True),
    ("GET", f"{API}/studies/{{study_id}}/evaluations"): Access(VIEWER, conflicts=True),
    # global models: a site downloads only those of its own studies
    ("GET", f"{API}/studies/{{study_id}}/models"): Access(RESEARCHER),
    ("GET", f"{API}/studies/{{study_id}}/models/{{number}}"): Access(RESEARCHER | SITE),
    ("GET", f"{API}/studies/{{study_id}}/models/{{number}}/local"): Access(RESEARCHER | SITE),
    # a researcher's model files, for an evaluate study to name by digest
    ("POST", f"{API}/models"): Access(RESEARCHER),
    # the agent's: a site uploads only to rounds it was selected for
    ("GET", f"{API}/tasks/next"): Access(SITE),
    ("POST", f"{API}/rounds/{{round_id}}/updates"): Access(SITE, conflicts=True),
    ("GET", f"{API}/rounds/{{round_id}}/updates/sessions/{{sha256}}"): Access(SITE),
    ("PATCH", f"{API}/rounds/{{round_id}}/updates/sessions/{{sha256}}"): Access(SITE, conflicts=True),
    ("POST", f"{API}/rounds/{{round_id}}/decline"): Access(SITE),
    ("GET", f"{API}/rounds/{{round_id}}/secagg"): Access(SITE, conflicts=True),  # 409: not a secure round
    ("POST", f"{API}/rounds/{{round_id}}/secagg/advertisement"): Access(SITE, conflicts=True),
    ("POST", f"{API}/rounds/{{round_id}}/secagg/shares"): Access(SITE, conflicts=True),
    ("POST", f"{API}/rounds/{{round_id}}/secagg/consistency"): Access(SITE, conflicts=True),
    ("POST", f"{API}/rounds/{{round_id}}/secagg/reveal"): Access(SITE, conflicts=True),
    # the agent's jobs outside rounds: surveys, external validation, evaluations (shared/wire/jobs.py)
    ("GET", f"{API}/jobs"): Access(SITE),
    ("POST", f"{API}/studies/{{study_id}}/reports/{{kind}}/{{number}}"): Access(SITE, conflicts=True),
    # status, health, metrics, the dashboard page and the API's own documents
    ("GET", f"{API}/status"): Access(VIEWER),
    ("GET", f"{API}/health"): Access(NO_TOKEN),
    ("GET", "/metrics"): Access(VIEWER),
    ("GET", "/dashboard"): Access(NO_TOKEN),
    ("GET", "/openapi.json"): Access(NO_TOKEN),
    ("GET", "/docs"): Access(NO_TOKEN),
    ("GET", "/docs/oauth2-redirect"): Access(NO_TOKEN),
    ("GET", "/redoc"): Access(NO_TOKEN),
}


def role_names(roles: Roles) -> list[str]:
    """The roles' names in the order Role declares them."""
    return [role.value for role in Role if role in roles]


def template_pattern(template: str) -> re.Pattern[str]:
    """A regular expression of the paths that a path template such as `/studies/{study_id}` matches."""
    return re.compile(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)))


# Literal segments before parameters, as routes are declared: GET /sites/me is not a site called "me".
_MATCHERS = sorted(
    ((method, template_pattern(template), access) for (method, template), access in ROUTES.items()),
    key=lambda matcher: matcher[1].pattern.count("[^/]+"),
)


def access_for(method: str, path: str) -> Access | None:
    """The entry of ROUTES for a request (HEAD is GET's); None when no entry matches."""
    method = "GET" if method == "HEAD" else method
    return next((access for m, pattern, access in _MATCHERS if m == method and pattern.fullmatch(path)), None)
