"""Tokens: issue researcher/viewer/admin tokens, list and revoke any token (admin); who am I (anyone)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from coordinator.api.deps import Caller, Id, SessionDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.models import Role
from coordinator.sites import access
from shared.wire.api import Page, TokenCreate, TokenIssued, TokenPublic

router = APIRouter(prefix="/tokens", tags=["tokens"], route_class=SessionReleasingRoute)


@router.post("", status_code=201)
def create_token(body: TokenCreate, admin: Caller, session: SessionDep) -> TokenIssued:
    """Issue a token for a person; the secret is in the response and is never shown again."""
    token, secret = access.create_token(session, role=Role(body.role), label=body.label, by=admin)
    return TokenIssued(id=token.id, role=token.role, token=secret)


@router.get("")
def read_tokens(session: SessionDep) -> Page[TokenPublic]:
    """Every token, without secrets."""
    tokens = [
        TokenPublic.model_validate(token).model_copy(update={"site": site})
        for token, site in access.list_tokens(session)
    ]
    return Page(data=tokens, count=len(tokens))


@router.get("/me")
def read_own_token(caller: Caller) -> dict[str, str | int | None]:
    """The caller's role and identity."""
    return {"role": caller.role.value, "actor": caller.actor, "token_id": caller.token_id, "site": caller.site_name}


@router.delete("/{token_id:id}", status_code=204)  # a number: DELETE /tokens/me is 405, not 422
def revoke_token(token_id: Id, admin: Caller, session: SessionDep) -> Response:
    """Revoke a token: every later request holding it gets 401."""
    access.revoke_token(session, token_id=token_id, by=admin)
    return Response(status_code=204)
