"""API tokens: random secrets shown once, stored as sha256, checked in constant time; who is calling."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

from pydantic import SecretStr
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from coordinator.db import utc_now
from coordinator.errors import Forbidden, Unauthenticated
from coordinator.models import Role, Site, Token

__all__ = ["Principal", "authenticate", "hash_token", "mark_seen", "new_token"]

TOKEN_PREFIX = "cfl_"
_LAST_SEEN_RESOLUTION = timedelta(seconds=5)  # a site's last_seen_at is written at most this often


def new_token() -> str:
    """A fresh secret with 256 bits of entropy."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """What is stored for a token: plain sha256 suffices for secrets of this entropy."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """The authenticated caller of a request."""

    role: Role
    actor: str  # for audit events: "admin:env", "token:<id>", "site:<name>"
    token_id: int | None = None  # None for the bootstrap admin token
    site_id: int | None = None
    site_name: str | None = None

    def require(self, *roles: Role) -> Principal:
        """Raise Forbidden unless the caller has one of `roles`."""
        if self.role not in roles:
            needs = ", ".join(role.value for role in Role if role in roles)
            raise Forbidden(f"role {self.role.value!r} may not do this (needs {needs})")
        return self


def authenticate(session: Session, token: str, admin_token: SecretStr | None) -> tuple[Principal, bool]:
    """The principal holding `token`, and whether its site's last_seen_at is due to be written (see mark_seen).

    Only reads, so a session that takes no write lock will do. Unauthenticated when the token is
    unknown or revoked.
    """
    digest = hash_token(token)
    if admin_token is not None and admin_token.get_secret_value():
        if hmac.compare_digest(digest, hash_token(admin_token.get_secret_value())):
            return Principal(Role.ADMIN, actor="admin:env"), False
    row = session.execute(
        select(Token, Site).outerjoin(Site, Token.site_id == Site.id).where(Token.token_hash == digest)
    )
    found = row.one_or_none()
    if found is None or not hmac.compare_digest(found.Token.token_hash, digest):
        raise Unauthenticated("unknown token")
    stored, site = found.Token, found.Site
    if stored.revoked_at is not None:
        raise Unauthenticated("token revoked")
    role = Role(stored.role)
    if role is not Role.SITE or site is None:
        return Principal(role, actor=f"token:{stored.id}", token_id=stored.id), False
    principal = Principal(role, actor=f"site:{site.name}", token_id=stored.id, site_id=site.id, site_name=site.name)
    return principal, site.last_seen_at is None or utc_now() - site.last_seen_at > _LAST_SEEN_RESOLUTION


def mark_seen(session: Session, site_id: int) -> None:
    """Record that site `site_id` called just now (commits)."""
    session.execute(update(Site).where(Site.id == site_id).values(last_seen_at=utc_now()))
    session.commit()
