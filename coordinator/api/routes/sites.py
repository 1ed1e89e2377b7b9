"""Sites: enrol (admin), list, rotate a site's token (admin), a site's view of itself and of its studies."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from coordinator.api.deps import Caller, Id, SessionDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.sites import access, approvals
from shared.wire.api import Page, SigningKey, SiteCreate, SiteEnrolled, SitePublic, TokenIssued
from shared.wire.protocol import ApprovalReport, StudyOffer

router = APIRouter(prefix="/sites", tags=["sites"], route_class=SessionReleasingRoute)


@router.post("", status_code=201)
def enrol_site(body: SiteCreate, admin: Caller, session: SessionDep) -> SiteEnrolled:
    """Enrol a site; its token is in the response and is never shown again."""
    site, token, secret = access.enrol_site(session, name=body.name, by=admin)
    return SiteEnrolled(
        site=SitePublic.model_validate(site),
        token=TokenIssued(id=token.id, role=token.role, site=site.name, token=secret),
    )


@router.get("")
def read_sites(session: SessionDep) -> Page[SitePublic]:
    """Every enrolled site with its last contact."""
    sites = [SitePublic.model_validate(site) for site in access.list_sites(session)]
    return Page(data=sites, count=len(sites))


@router.get("/me")
def read_own_site(site: Caller, session: SessionDep) -> SitePublic:
    """The calling site (lets an agent check its token)."""
    assert site.site_name is not None
    return SitePublic.model_validate(access.get_site(session, site.site_name))


@router.get("/me/studies")
def read_offered_studies(
    site: Caller,
    session: SessionDep,
    finished: bool = Query(False, description="also list completed, failed and cancelled studies"),
) -> Page[StudyOffer]:
    """The studies that list the calling site, each with what the site needs to describe and approve it."""
    listed = approvals.offers(session, site, finished=finished)
    return Page(data=listed, count=len(listed))


@router.put("/me/signing-key", status_code=204)
def register_signing_key(body: SigningKey, site: Caller, session: SessionDep) -> Response:
    """The calling site's long-term Ed25519 public key (once for life; the same key again is a no-op)."""
    access.register_signing_key(session, site=site, public_key=body.public_key)
    return Response(status_code=204)


@router.put("/me/studies/{study_id}/approval", status_code=204)
def report_approval(study_id: Id, body: ApprovalReport, site: Caller, session: SessionDep) -> Response:
    """The calling site reports whether its operator approved the study, with the digest it computed.

    403 not_a_participant for a study that does not list the site, and alike for one that does not exist.
    """
    approvals.report_approval(session, site, study_id, body, utc_now())
    return Response(status_code=204)


@router.post("/{name}/token", status_code=201)
def rotate_site_token(name: str, admin: Caller, session: SessionDep) -> TokenIssued:
    """Revoke the site's tokens and issue a new one (shown once)."""
    token, secret = access.rotate_site_token(session, name=name, by=admin)
    return TokenIssued(id=token.id, role=token.role, site=name, token=secret)
