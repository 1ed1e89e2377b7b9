"""The approval page's server: the site's offered studies and state; approve, decline or revoke, for its data owner.

It listens on 127.0.0.1 only and answers the API only with its own random token (sent by the page's
JS as a bearer header, never a cookie). A state-changing request is a JSON POST carrying that token
and an Origin of this very server: a page of another origin can neither read the token nor send the
header without a preflight this server never grants. Approving, declining and revoking run the very
code of `cardiofl site approve`, `cardiofl site decline` and `cardiofl site revoke-approval`
(site_agent/approvals.py), and an approval or a decline names the digest the person reviewed:
another current digest is refused. A decline's reason stays at the site.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.middleware.trustedhost import TrustedHostMiddleware

from shared.study.description import StudyDescription, terms_differences
from shared.wire.protocol import StudyOffer
from site_agent.approvals import REASON_CHARS, Approvals, Decision, task_declines
from site_agent.client import CoordinatorClient
from site_agent.errors import AgentError, CoordinatorUnavailable

__all__ = ["SiteUi", "create_app", "new_token"]

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
STATIC = {"page.js": "text/javascript", "page.css": "text/css"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def new_token() -> str:
    """A fresh random token of the page (256 bits)."""
    return secrets.token_urlsafe(32)


@dataclass
class SiteUi:
    """What the page shows and changes: the site's approvals, a coordinator client per request, the heartbeat file."""

    approvals: Approvals
    client: Callable[[], CoordinatorClient]  # a fresh client of the coordinator, closed after each request
    token: str
    operator: str  # who approves, as `cardiofl site approve` records it ("operator NAME")
    describe: Callable[[StudyDescription], list[str]]  # the description's lines, as `cardiofl site studies` prints
    heartbeat: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class DigestBody(BaseModel):
    """An approval names the digest the person reviewed."""

    digest: str = Field(min_length=64, max_length=64, pattern="^[0-9a-f]{64}$")


class DeclineBody(DigestBody):
    """A decline names the digest the person reviewed, and why (the reason stays at the site)."""

    reason: str = Field(min_length=1, max_length=REASON_CHARS)


def _state(decision: Decision) -> str:
    if decision.approved:
        return "approved"
    if decision.declined:
        return "declined"
    return "approval outdated" if decision.outdated else "awaiting approval"


def _summary(description: StudyDescription) -> dict[str, Any]:
    """The terms in plain words: what runs, what leaves the site, epsilon under DP, the secure-aggregation adversary."""
    terms = description.terms
    privacy = terms.privacy
    runs = (
        f"a {terms.kind} study: model {terms.model.preset}, algorithm {terms.algorithm.name}, "
        f"aggregation {terms.aggregation.name}, {terms.rounds} round(s) over {len(terms.sites)} site(s)"
    )
    tensors = (
        f"each upload: {len(description.uploads)} tensors, {description.upload_values:,} numbers "
        f"({description.upload_bytes / 1e6:.1f} MB)"
        if description.uploads
        else "no tensor leaves the site"
    )
    secure = privacy.secure_aggregation
    return {
        "runs": runs,
        "leaves": [tensors, *description.statistics],
        "epsilon": _epsilon(description),
        "adversary": None if secure is None else secure.colluding_among(len(terms.sites)),
        "min_records": privacy.min_records,
    }


def _epsilon(description: StudyDescription) -> str | None:
    """The study's (epsilon, delta) under differential privacy, after all its rounds; None without DP."""
    dp = description.terms.privacy.dp
    if dp is None:
        return None
    try:
        from shared.study.accounting import dp_accounting, epsilon_after, trained_rounds

        accounting = dp_accounting(description.terms)
        assert accounting is not None
        epsilon = epsilon_after(accounting, trained_rounds(description.terms))
    except Exception as exc:  # noqa: BLE001 - the page still shows z and delta from the description
        log.warning("epsilon not computed: %s", exc)
        return f"noise multiplier {dp.noise_multiplier:g}, delta {dp.delta:g} (epsilon not computed here)"
    budget = f", budget {dp.epsilon_budget:g}" if dp.epsilon_budget else ""
    return f"epsilon {epsilon:.3g} at delta {dp.delta:g} after all rounds ({dp.mode} DP{budget})"


def _study(ui: SiteUi, offer: StudyOffer, decision: Decision) -> dict[str, Any]:
    """One offered study as the page shows it."""
    recorded, decline = decision.recorded, decision.decline
    previous = decision.approved_terms()
    changed = terms_differences(previous, decision.description.terms) if previous is not None else []
    return {
        "study_id": offer.study_id,
        "study_uid": offer.study_uid,
        "name": offer.name,
        "status": offer.status,
        "state": _state(decision),
        "digest": decision.digest,
        "summary": _summary(decision.description),
        "lines": ui.describe(decision.description),
        "changes": changed if decision.outdated else [],
        "recorded": None
        if recorded is None
        else {key: recorded.get(key) for key in ("digest", "approved_at", "approved_by")},
        "declined": None
        if decline is None
        else {key: decline.get(key) for key in ("digest", "declined_at", "declined_by", "reason")},
    }


def _last_poll(heartbeat: Path | None) -> dict[str, Any] | None:
    """When the agent last polled (its heartbeat file, as `cardiofl site health` reads it); None: no heartbeat."""
    if heartbeat is None:
        return None
    try:
        at = float(heartbeat.read_text().strip())
    except (OSError, ValueError):
        return None
    return {"at": datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds"), "age_s": round(time.time() - at)}


def _declines(ui: SiteUi) -> list[dict[str, Any]]:
    """The operator's declines of studies and the agent's of tasks, each with its reason, newest first."""
    rows = [
        {
            "what": "study",
            "study_id": record.get("study_id"),
            "round": None,
            "at": record.get("declined_at"),
            "by": record.get("declined_by"),
            "digest": record.get("digest"),
            "reason": record.get("reason"),
        }
        for record in ui.approvals.declines()
    ]
    rows += [
        {
            "what": "task",
            "study_id": record.get("study_id"),
            "round": record.get("round"),
            "at": record.get("at"),
            "by": "this site's agent",
            "digest": None,
            "reason": record.get("reason"),
        }
        for record in task_declines(ui.approvals.store)
    ]
    return sorted(rows, key=lambda row: str(row["at"] or ""), reverse=True)


def _site_state(ui: SiteUi) -> dict[str, Any]:
    """The site's own state: last poll, approved studies with their committed rounds, uploads pending, declines."""
    store = ui.approvals.store
    approved = []
    for key in store.approved_studies():
        record = store.load_approval(key) or {}
        rounds = store.local_rounds(key)
        approved.append(
            {
                "key": key,
                "study_id": record.get("study_id"),
                "digest": record.get("digest"),
                "approved_at": record.get("approved_at"),
                "approved_by": record.get("approved_by"),
                "latest_round": rounds[-1] if rounds else None,
            }
        )
    return {
        "site": store.site,
        "last_poll": _last_poll(ui.heartbeat),
        "heartbeat_configured": ui.heartbeat is not None,
        "approved": approved,
        "pending_uploads": store.pending_studies(),
        "declines": _declines(ui),
    }


@contextmanager
def _connected(ui: SiteUi) -> Iterator[CoordinatorClient]:
    """A client of the coordinator for one request, closed after it."""
    client = ui.client()
    with client.http:
        yield client


def _offer(client: CoordinatorClient, study_id: int, *, finished: bool = False) -> StudyOffer:
    for offer in client.offers(finished=finished):
        if offer.study_id == study_id:
            return offer
    raise HTTPException(404, f"study {study_id} does not list this site{'' if finished else ', or has ended'}")


def _reviewed(ui: SiteUi, offer: StudyOffer, digest: str, action: str) -> Decision:
    """The site's decision on the offered study; 409 unless `digest` is its current one (the one reviewed)."""
    decision = ui.approvals.decide(offer)
    if digest != decision.digest:
        raise HTTPException(
            409,
            f"study {offer.study_id}'s description now has the digest {decision.digest}, not the {digest} "
            f"you reviewed: nothing was {action}; review what changed",
        )
    return decision


def _tell(ui: SiteUi, client: CoordinatorClient, offer: StudyOffer) -> str | None:
    """Tell the coordinator the site's state on the study, as the CLI does; why not, when it could not."""
    try:
        ui.approvals.report(client, ui.approvals.decide(offer), told=offer.approval)
    except (CoordinatorUnavailable, AgentError) as exc:
        return f"the coordinator was not told ({exc}); the agent tells it at its next poll"
    return None


def _decline(ui: SiteUi, study_id: int, body: DeclineBody) -> JSONResponse:
    """Record the decline of the study's reviewed digest, with its reason, as `cardiofl site decline` does."""
    with ui.lock, _connected(ui) as client:
        offer = _offer(client, study_id)
        decision = _reviewed(ui, offer, body.digest, "declined")
        if decision.declined:
            return JSONResponse({"message": f"study {study_id} is already declined", "digest": decision.digest})
        try:
            ui.approvals.decline(offer, by=ui.operator, reason=body.reason, description=decision.description)
        except AgentError as exc:
            raise HTTPException(422, str(exc)) from None
        note = _tell(ui, client, offer)
    message = f"declined study {study_id} (digest {decision.digest}); this site's agent trains for none of it"
    return JSONResponse({"message": message + (f"; {note}" if note else ""), "digest": decision.digest})


def _authorize(ui: SiteUi, request: Request, *, changes: bool = False) -> None:
    """401 without the page's token; for a change, 403 unless the request comes from this very origin."""
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), ui.token.encode()):
        raise HTTPException(401, "the page's token is missing or wrong: open the URL `cardiofl site ui` printed")
    if not changes:
        return
    origin = request.headers.get("origin")
    expected = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin != expected or request.headers.get("sec-fetch-site", "same-origin") != "same-origin":
        raise HTTPException(403, "cross-origin request refused")
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise HTTPException(415, "send JSON")


def create_app(ui: SiteUi, *, allowed_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> FastAPI:
    """The page and its API over the site's store (`allowed_hosts`: the Host names served, against DNS rebinding)."""
    app = FastAPI(title="cardiofl site approvals", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Callable[[Request], Any]) -> Response:
        response: Response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(HERE / "page.html", media_type="text/html")

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> FileResponse:
        if name not in STATIC:
            raise HTTPException(404, "no such file")
        return FileResponse(HERE / name, media_type=STATIC[name])

    @app.get("/api/state")
    def state(request: Request) -> dict[str, Any]:
        _authorize(ui, request)
        with ui.lock:
            studies, problem = [], None
            try:
                with _connected(ui) as client:
                    studies = [_study(ui, offer, ui.approvals.decide(offer)) for offer in client.offers(finished=False)]
            except (CoordinatorUnavailable, AgentError) as exc:
                problem = f"the coordinator could not be asked for this site's studies: {exc}"
            return {"studies": studies, "error": problem, "site": _site_state(ui)}

    def change(request: Request) -> None:  # before the body is read: 401 and 403 come first
        _authorize(ui, request, changes=True)

    @app.post("/api/studies/{study_id}/approve", dependencies=[Depends(change)])
    def approve(study_id: int, body: DigestBody) -> JSONResponse:
        with ui.lock, _connected(ui) as client:
            offer = _offer(client, study_id)
            decision = _reviewed(ui, offer, body.digest, "approved")
            if decision.approved:
                return JSONResponse({"message": f"study {study_id} is already approved", "digest": decision.digest})
            try:
                ui.approvals.approve(offer, by=ui.operator, description=decision.description)
            except AgentError as exc:
                raise HTTPException(422, str(exc)) from None
            decision = replace(decision, approved=True)
            note = _tell(ui, client, offer)
        message = f"approved study {study_id} (digest {decision.digest})" + (f"; {note}" if note else "")
        return JSONResponse({"message": message, "digest": decision.digest})

    @app.post("/api/studies/{study_id}/decline", dependencies=[Depends(change)])
    def decline(study_id: int, body: DeclineBody) -> JSONResponse:
        return _decline(ui, study_id, body)

    @app.post("/api/studies/{study_id}/revoke", dependencies=[Depends(change)])
    def revoke(study_id: int) -> JSONResponse:
        with ui.lock:
            keys = [key for key in ui.approvals.store.approved_studies() if key.split("-", 1)[0] == str(study_id)]
            if not keys:
                raise HTTPException(404, f"study {study_id} has no recorded approval at this site")
            for key in keys:
                ui.approvals.revoke(study_id, key.split("-", 1)[1])
            message = f"revoked the approval of study {study_id}; this site's agent trains for none of its later rounds"
            try:
                with _connected(ui) as client:
                    note = _tell(ui, client, _offer(client, study_id, finished=True))
            except HTTPException as exc:
                note = f"the coordinator was not told ({exc.detail})"
            except CoordinatorUnavailable as exc:
                note = f"the coordinator was not told ({exc}); the agent tells it at its next poll"
        return JSONResponse({"message": message + (f"; {note}" if note else "")})

    return app
