"""The demo's study lifecycle around training: a data-readiness survey first, external validation after.

`run_survey` runs a survey study of every demo site and prints its table (what each site released,
pooled); `external_lines` words the held-out validation sites' evaluations of the released models.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console

from cardiofl.client.http import CardioflClient
from cardiofl.demo_study import DemoPlan, held_out
from shared.evaluation.survey import survey_text
from shared.wire.api import StudyPublic
from shared.wire.jobs import ExternalResult, ExternalResults, SurveyResults
from shared.wire.metrics import MetricSummary, figure_text

__all__ = [
    "await_external",
    "external_lines",
    "external_validation",
    "run_survey",
    "survey_config",
    "survey_first",
    "survey_table",
]

FINISHED = ("completed", "failed", "cancelled")
FIGURES = (("macro-AUROC", "macro_auroc"), ("micro-F1", "micro_f1"), ("mAP", "map"))


def survey_config(sites: Sequence[str], *, min_records: int, deadline_s: float) -> dict[str, Any]:
    """A survey study of `sites`: each releases its survey once, suppressed below `min_records`."""
    return {
        "kind": "survey",
        "sites": list(sites),
        "min_sites": len(sites),
        "round_deadline_s": deadline_s,
        "privacy": {"min_records": min_records},
    }


def run_survey(
    api: CardioflClient,
    sites: Sequence[str],
    *,
    min_records: int,
    deadline_s: float,
    alive: Callable[[], None],
    timeout_s: float = 600.0,
) -> SurveyResults:
    """Create, start and await a survey study of `sites`; its results once it finished."""
    study = api.create_study(
        "Data-readiness survey", survey_config(sites, min_records=min_records, deadline_s=deadline_s)
    )
    api.study_action(study.id, "start")
    deadline = time.monotonic() + timeout_s
    while api.study(study.id).status not in FINISHED:
        alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the survey study {study.id} did not finish within {timeout_s:.0f}s")
        time.sleep(0.5)
    return api.survey(study.id)


def survey_table(results: SurveyResults) -> str:
    """The survey's plain-text table (per site and pooled, every group), or why there is none."""
    if not results.sites:
        return f"no site reported its survey (awaiting {', '.join(results.awaiting)})"
    cells = {reported.site: reported.survey.cells() for reported in results.sites}
    return survey_text(cells, min_records=results.min_records, noise_sigma=results.noise_sigma)


def await_external(
    api: CardioflClient, study_id: int, final_round: int, alive: Callable[[], None], timeout_s: float = 120.0
) -> ExternalResults:
    """The study's external validations once every validation site evaluated theta^g of `final_round`."""
    deadline = time.monotonic() + timeout_s
    while True:
        results = api.external(study_id)
        done = {result.site for result in results.results if result.round == final_round}
        if done >= set(results.validation_sites) or time.monotonic() > deadline:
            return results
        alive()
        time.sleep(0.5)


def _line(result: ExternalResult, final_round: int | None) -> str:
    """One validation site's evaluation of one released model, as the demo prints it."""
    summary = MetricSummary.model_validate(result.evaluation.model_dump())
    final = " (final)" if result.round == final_round else ""
    figures = ", ".join(f"{label} {figure_text(summary, name)}" for label, name in FIGURES)
    return (
        f"external validation at {result.site} (never trained), global model of round {result.round}{final}: "
        f"{summary.n_samples} records, {figures}"
    )


def external_lines(results: ExternalResults) -> list[str]:
    """One line per validation site and evaluated round, oldest round first."""
    if not results.validation_sites:
        return []
    ordered = sorted(results.results, key=lambda result: (result.round, result.site))
    final = {result.site for result in ordered if result.round == results.final_round}
    missing = [site for site in results.validation_sites if site not in final]
    waiting = [f"external validation at {site}: no report of the final global model yet" for site in missing]
    return [_line(result, results.final_round) for result in ordered] + waiting


def survey_first(
    api: CardioflClient, plan: DemoPlan, names: list[str], alive: Callable[[], None], console: Console
) -> SurveyResults | None:
    """The demo's survey of every site, its table printed (None with `plan.survey` off); names the held-out sites."""
    survey = None
    if plan.survey:
        console.print(f"data-readiness survey of {', '.join(names)} (counts below {plan.min_records} suppressed):")
        survey = run_survey(api, names, min_records=plan.min_records, deadline_s=plan.deadline_s, alive=alive)
        console.print(survey_table(survey), soft_wrap=True, highlight=False)
    held = held_out(plan, names)[1]
    if held:
        console.print(f"held out of training, validating each released model: {', '.join(held)}")
    return survey


def external_validation(
    api: CardioflClient, study: StudyPublic, alive: Callable[[], None], console: Console
) -> ExternalResults | None:
    """The held-out sites' evaluations of a completed study's models, printed a line each (None without any)."""
    if not study.config.validation_sites or study.status != "completed":
        return None
    external = await_external(api, study.id, study.completed_rounds, alive)
    for line in external_lines(external):
        console.print(line, soft_wrap=True, highlight=False)
    return external
