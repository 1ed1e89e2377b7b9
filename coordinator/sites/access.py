"""Sites and tokens: enrolment, token creation, rotation and revocation (admin operations)."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from coordinator import audit
from coordinator.db import utc_now
from coordinator.errors import AlreadyExists, Conflict, NotFound, Unprocessable
from coordinator.models import Role, Site, Token
from coordinator.sites.security import Principal, hash_token, new_token

__all__ = [
    "create_token",
    "enrol_site",
    "get_site",
    "list_sites",
    "list_tokens",
    "register_signing_key",
    "revoke_token",
    "rotate_site_token",
    "signing_keys",
]


def _issue(session: Session, role: Role, label: str, site: Site | None = None) -> tuple[Token, str]:
    secret = new_token()
    token = Token(token_hash=hash_token(secret), role=role.value, label=label, site_id=site.id if site else None)
    session.add(token)
    session.flush()
    return token, secret


def enrol_site(session: Session, *, name: str, by: Principal) -> tuple[Site, Token, str]:
    """Enrol a site and issue its first token; the secret is returned once and never stored."""
    site = Site(name=name)
    session.add(site)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise AlreadyExists(f"site {name!r} is already enrolled") from None
    token, secret = _issue(session, Role.SITE, f"site {name}", site)
    audit.record(session, "site.enrolled", actor=by.actor, site_id=site.id, name=name, token_id=token.id)
    session.commit()
    return site, token, secret


def get_site(session: Session, name: str) -> Site:
    """The enrolled site called `name`."""
    site = session.scalar(select(Site).where(Site.name == name))
    if site is None:
        raise NotFound(f"site {name!r}")
    return site


def register_signing_key(session: Session, *, site: Principal, public_key: str) -> bool:
    """Record the site's long-term signing key (hex); False when it was registered already.

    A site has one key for life: another key for a site that has one is a Conflict (its secure
    studies' terms name the first, so a new one would go with new terms, and new approvals).
    """
    assert site.site_name is not None
    row = get_site(session, site.site_name)
    if row.signing_key == public_key:
        session.rollback()
        return False
    if row.signing_key is not None:
        session.rollback()
        raise Conflict(
            f"site {site.site_name!r} has another signing key registered; a site keeps one key for life",
            code="signing_key_conflict",
        )
    row.signing_key = public_key
    audit.record(session, "site.signing_key", actor=site.actor, site_id=row.id, key=public_key)
    session.commit()
    return True


def signing_keys(session: Session, names: list[str]) -> dict[str, str | None]:
    """Each named site's registered signing key (hex), None where its agent has not registered one yet."""
    rows = dict(session.execute(select(Site.name, Site.signing_key).where(Site.name.in_(names))).all())
    return {name: rows.get(name) for name in names}


def list_sites(session: Session) -> list[Site]:
    """Every enrolled site, by name."""
    return list(session.scalars(select(Site).order_by(Site.name)))


def rotate_site_token(session: Session, *, name: str, by: Principal) -> tuple[Token, str]:
    """Revoke every live token of the site and issue a new one, in one transaction."""
    site = get_site(session, name)
    now = utc_now()
    revoked = session.scalars(
        update(Token)
        .where(Token.site_id == site.id, Token.revoked_at.is_(None))
        .values(revoked_at=now)
        .returning(Token.id)
    ).all()
    token, secret = _issue(session, Role.SITE, f"site {name}", site)
    audit.record(session, "token.rotated", actor=by.actor, site_id=site.id, revoked=list(revoked), token_id=token.id)
    session.commit()
    return token, secret


def create_token(session: Session, *, role: Role, label: str, by: Principal) -> tuple[Token, str]:
    """Issue an admin, researcher or viewer token (site tokens come with enrolment or rotation)."""
    if role is Role.SITE:
        raise Unprocessable("site tokens are issued by enrolling or rotating a site", code="invalid_role")
    token, secret = _issue(session, role, label)
    audit.record(session, "token.created", actor=by.actor, token_id=token.id, role=role.value, label=label)
    session.commit()
    return token, secret


def list_tokens(session: Session) -> list[tuple[Token, str | None]]:
    """Every token (never a secret) with its site's name, oldest first."""
    rows = session.execute(select(Token, Site.name).outerjoin(Site, Token.site_id == Site.id).order_by(Token.id))
    return [(row.Token, row.name) for row in rows]


def revoke_token(session: Session, *, token_id: int, by: Principal) -> Token:
    """Revoke a token; requests holding it are refused from the commit on."""
    token = session.get(Token, token_id)
    if token is None:
        raise NotFound(f"token {token_id}")
    if token.revoked_at is None:
        token.revoked_at = utc_now()
        audit.record(session, "token.revoked", actor=by.actor, token_id=token_id, site_id=token.site_id)
        session.commit()
    return token
