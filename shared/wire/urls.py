"""The API paths a site and its coordinator both derive: the coordinator names them, the site checks them."""

from __future__ import annotations

__all__ = ["API", "decline_url", "global_model_url", "initial_local_url", "secure_url", "update_url"]

API = "/api/v1"


def global_model_url(study_id: int, round_number: int) -> str:
    """GET: theta^g_t of a study."""
    return f"{API}/studies/{study_id}/models/{round_number}"


def initial_local_url(study_id: int) -> str:
    """GET: phi_0 of a study, beside theta^g_0."""
    return f"{API}/studies/{study_id}/models/0/local"


def update_url(round_id: int) -> str:
    """POST: a site's update of a round attempt."""
    return f"{API}/rounds/{round_id}/updates"


def decline_url(round_id: int) -> str:
    """POST: a site declines its task of a round attempt, saying why."""
    return f"{API}/rounds/{round_id}/decline"


def secure_url(round_id: int) -> str:
    """GET: a secure round's phase; POST .../advertisement, .../shares, .../reveal."""
    return f"{API}/rounds/{round_id}/secagg"
