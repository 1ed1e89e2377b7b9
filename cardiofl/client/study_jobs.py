"""What `study show` and `study watch` add for a study's site jobs: its kind's results, read from the coordinator.

A training study with validation sites: its external validation (GET /studies/{id}/external); an evaluate
study: its per-site evaluations (/evaluations); a survey study: its pooled records per group, and a
pointer to `cardiofl study survey` for the tables (/survey). A training study without validation sites
reads nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel
from rich.console import RenderableType

from cardiofl.client.http import CardioflClient
from cardiofl.client.job_figures import evaluation_table, external_line, external_table, survey_records_lines
from shared.wire.api import StudyPublic
from shared.wire.jobs import EvaluationResults, ExternalResults, SurveyResults

__all__ = ["ExternalWatch", "job_renderables", "job_views"]


def job_views(client: CardioflClient, study: StudyPublic) -> dict[str, BaseModel]:
    """The job results the study's kind has, by the key `study show --json` gives them ({} for a plain study)."""
    terms = study.config
    if terms.kind == "survey":
        return {"survey": client.survey(study.id)}
    if terms.kind == "evaluate":
        return {"evaluations": client.evaluations(study.id)}
    if terms.validation_sites:
        return {"external": client.external(study.id)}
    return {}


def job_renderables(views: dict[str, BaseModel], url: str) -> list[RenderableType]:
    """What `study show` prints of them, after the training sites' tables (hints name coordinator `url`)."""
    shown: list[RenderableType] = []
    for view in views.values():
        if isinstance(view, ExternalResults):
            every = (
                "every released model" if view.every == 1 else f"theta^g_t of rounds {view.every}, {2 * view.every}, …"
            )
            shown.append(
                f"\nvalidation sites (never trained, not in the tables above): {', '.join(view.validation_sites)}\n"
                f"  each evaluates {every} and the final one, on all its records"
            )
            shown.append(external_table(view))
        elif isinstance(view, EvaluationResults):
            shown.append(evaluation_table(view))
        elif isinstance(view, SurveyResults):
            shown.append("\n".join(survey_records_lines(view, url)))
    return shown


@dataclass
class ExternalWatch:
    """The validation sites' results `study watch` has printed, to print each new one once."""

    client: CardioflClient
    study_id: int
    shown: set[tuple[int, str]] = field(default_factory=set)

    def new_lines(self) -> list[str]:
        """A line per result not printed yet, oldest round first."""
        results = self.client.external(self.study_id)
        order = {site: index for index, site in enumerate(results.validation_sites)}
        lines = []
        for result in sorted(results.results, key=lambda r: (r.round, order.get(r.site, len(order)), r.site)):
            if (result.round, result.site) not in self.shown:
                self.shown.add((result.round, result.site))
                lines.append(external_line(result, results.final_round))
        return lines
