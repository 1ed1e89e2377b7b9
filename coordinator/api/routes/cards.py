"""A study's model card: JSON, or rendered as Markdown or HTML for people."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from coordinator.api.deps import MAX_ID, Id, SessionDep
from coordinator.api.session_routes import SessionReleasingRoute
from coordinator.db import utc_now
from coordinator.studies import lifecycle as studies
from coordinator.studies.card import model_card
from coordinator.studies.card_render import card_html, card_markdown
from shared.wire.card import CardFormat, ModelCard

router = APIRouter(prefix="/studies", tags=["studies"], route_class=SessionReleasingRoute)

MEDIA_TYPES = {"md": "text/markdown; charset=utf-8", "html": "text/html; charset=utf-8"}
# The HTML card loads nothing and runs nothing: its style and its diagram are inline.
HTML_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}
TEXT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/markdown": {"schema": {"type": "string"}}, "text/html": {"schema": {"type": "string"}}}}
}


@router.get("/{study_id}/card", response_model=ModelCard, responses=TEXT)
def read_card(
    study_id: Id,
    session: SessionDep,
    card_format: Annotated[
        CardFormat, Query(alias="format", description="json (a ModelCard), md (Markdown) or html (one page)")
    ] = "json",
    baseline: int | None = Query(
        None, ge=0, le=MAX_ID, description="a study of algorithm `local` on the same sites to compare with"
    ),
    survey: int | None = Query(
        None,
        ge=0,
        le=MAX_ID,
        description="a survey study of the same sites for the Data section (default: the newest that surveyed them)",
    ),
) -> ModelCard | Response:
    """The study's model card: terms, approvals, data, per-site and pooled figures, validation, epsilon, limits.

    Every figure is the one GET /studies/{id}/rounds shows for the evaluated round (the final evaluation
    once the study has completed). 422 `baseline_not_local` when the baseline's algorithm is not `local`;
    422 `survey_not_survey` or `survey_not_comparable` when `survey` is no survey of every training site.
    """
    study = studies.get_study(session, study_id)
    compared = studies.get_study(session, baseline) if baseline is not None else None
    surveyed = studies.get_study(session, survey) if survey is not None else None
    card = model_card(session, study, utc_now(), compared, surveyed)
    if card_format == "md":
        return Response(card_markdown(card), media_type=MEDIA_TYPES["md"])
    if card_format == "html":
        return Response(card_html(card), media_type=MEDIA_TYPES["html"], headers=HTML_HEADERS)
    return card
