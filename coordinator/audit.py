"""Audit events: every state change, refusal and token operation is recorded with who, what, when and digest."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from coordinator.models import AuditEvent

__all__ = ["record"]


def record(
    session: Session,
    action: str,
    *,
    actor: str,
    study_id: int | None = None,
    round_id: int | None = None,
    site_id: int | None = None,
    digest: str | None = None,
    **detail: Any,
) -> None:
    """Add an audit event to the session's transaction (it commits with the change it describes)."""
    session.add(
        AuditEvent(
            actor=actor,
            action=action,
            study_id=study_id,
            round_id=round_id,
            site_id=site_id,
            digest=digest,
            detail=detail,
        )
    )
