"""The figures of site jobs as `cardiofl study show|watch|survey` print them: external validation, evaluations, surveys.

External validation (`external_table`, `external_lines`): each validation site's evaluation of a released
theta^g_t with phi_0 on all its records, per round and site, the final round marked; these sites never
trained, so their figures stand apart from the training sites' tables. An evaluate study
(`evaluation_table`): each site's figures of the named model as released and, where the terms ask,
after adapting its local tensors. A survey (`survey_table`, `survey_legend`): a row per table key, a
column per site and the pooled one (shared/evaluation/survey.py writes each pooled count).
Figures are written by `shared.wire.metrics.figure_text`, as the round tables write them.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from shared.evaluation.survey import HIDDEN, LOWER_BOUND, pool, survey_rows
from shared.tables import Table
from shared.wire.jobs import EvaluationResults, ExternalResult, ExternalResults, SurveyResults
from shared.wire.metrics import MetricSummary, figure_text
from shared.wire.protocol import EvalSummary

__all__ = [
    "GROUPS",
    "as_summary",
    "evaluation_table",
    "external_line",
    "external_table",
    "survey_legend",
    "survey_records_lines",
    "survey_table",
]

GROUPS = ("train", "test", "excluded")
_FIGURES = (("macro_auroc", "macro-AUROC"), ("micro_f1", "micro-F1"), ("map", "mAP"))  # columns, in order
DASH = "–"


def as_summary(evaluation: EvalSummary | None) -> MetricSummary | None:
    """A site's exact report as the summary type the figures are written from (the keys it set, no others)."""
    return None if evaluation is None else MetricSummary.model_validate(evaluation.model_dump(mode="json"))


def _figures(evaluation: EvalSummary | None) -> list[str]:
    """macro-AUROC with its 95% interval, micro-F1 and mAP (their intervals too, where the site sent them)."""
    summary = as_summary(evaluation)
    return [figure_text(summary, name, interval=name == "macro_auroc") for name, _ in _FIGURES]


def _round_label(t: int, final_round: int | None) -> str:
    return f"{t} (final)" if t == final_round else str(t)


def external_table(results: ExternalResults) -> Table:
    """Per evaluated round and validation site: records, macro-AUROC (95% interval), micro-F1, mAP; T marked final.

    A round some validation site has reported lists every validation site; those without a result are "awaiting".
    """
    by_key = {(r.round, r.site): r for r in results.results}
    rounds = sorted({r.round for r in results.results} | ({results.final_round} if results.final_round else set()))
    table = Table(
        "round t",
        "validation site",
        "records",
        *(label for _, label in _FIGURES),
        title="External validation: theta^g_t with phi_0 on all the records of sites that never trained it",
        caption="apart from the training sites' figures; (…): the site's 95% bootstrap interval",
    )
    for t in rounds:
        for site in results.validation_sites:
            result = by_key.get((t, site))
            if result is None:
                table.add_row(_round_label(t, results.final_round), site, "awaiting", *(DASH for _ in _FIGURES))
                continue
            table.add_row(
                _round_label(t, results.final_round),
                site,
                str(result.evaluation.n_samples),
                *_figures(result.evaluation),
                style="bold" if t == results.final_round else None,
            )
        table.add_section()
    if not rounds:
        table.add_row(DASH, "no validation site has reported yet", *(DASH for _ in range(4)))
    return table


def external_line(result: ExternalResult, final_round: int | None = None) -> str:
    """One validation site's evaluation in a line, as `study watch` prints it."""
    label = " (final)" if result.round == final_round else ""
    figures = ", ".join(
        f"{label_} {text}" for (_, label_), text in zip(_FIGURES, _figures(result.evaluation), strict=True)
    )
    return (
        f"  external: theta^g_{result.round}{label} at {result.site} (never trained), "
        f"{result.evaluation.n_samples} records: {figures}"
    )


def _evaluated(results: EvaluationResults) -> str:
    """The evaluated model in words: a completed study's final model, or the uploaded model file."""
    uid = results.evaluated_study_uid
    return f"the final model of study {uid}" if uid is not None else "the uploaded model file"


def evaluation_table(results: EvaluationResults) -> Table:
    """Each site's figures of the evaluated model as released and, adapted, after training its local tensors."""
    table = Table(
        "site",
        "model",
        "records",
        *(label for _, label in _FIGURES),
        title=f"Evaluation of {_evaluated(results)} (theta^g sha256 {results.model_sha256[:16]}…) at each site",
        caption="(…): the site's 95% bootstrap interval"
        + (
            f"; adapted: phi trained {results.adapt_local_epochs} epoch(s) on the site's own training split"
            if results.adapt_local_epochs
            else ""
        ),
    )
    for result in results.results:
        table.add_row(result.site, "as released", str(result.evaluation.n_samples), *_figures(result.evaluation))
        if result.adapted is not None:
            table.add_row(
                result.site,
                f"adapted on {result.adapt_records} records",
                str(result.adapted.n_samples),
                *_figures(result.adapted),
            )
    for site in results.awaiting:
        table.add_row(site, "awaiting", DASH, *(DASH for _ in _FIGURES))
    return table


def _cells(results: SurveyResults) -> dict[str, dict[tuple[str, str, str], int | None]]:
    return {reported.site: reported.survey.cells() for reported in results.sites}


def survey_table(results: SurveyResults, groups: Sequence[str] = GROUPS) -> Table:
    """A row per table key of `groups` pooled: a column per reporting site, and the pooled one (shared's pooling)."""
    sites = [reported.site for reported in results.sites]
    table = Table(
        "table",
        "key",
        *sites,
        "pooled",
        title=f"Survey of study {results.study_id}: {', '.join(groups)}, per site and pooled over {len(sites)} site(s)",
    )
    for column in table.columns[2:]:
        column.justify = "right"
    previous = None
    for row in survey_rows(_cells(results), groups):
        if previous is not None and row.table != previous:
            table.add_section()
        table.add_row(row.table, row.key, *(count.text() for count in row.sites), row.pooled.text())
        previous = row.table
    return table


def survey_legend(results: SurveyResults, groups: Sequence[str] = GROUPS) -> list[str]:
    """What the marks mean, the noise and what it spent, and who has not reported."""
    lines = [
        f"groups: {', '.join(groups)}",
        f"{HIDDEN} suppressed: a count below {results.min_records} (the study's min_records), or one hidden so that "
        "no such count can be worked out by subtraction",
        f"{LOWER_BOUND}n: the sum of the counts shown; some were suppressed, each at least 0",
    ]
    if results.noise_sigma is not None:
        spent = "" if results.epsilon is None else f": epsilon = {results.epsilon:.3f} at delta = {results.delta:g}"
        lines.append(f"each site's counts carry discrete Gaussian noise of sigma {results.noise_sigma:g}{spent}")
    if results.awaiting:
        lines.append(f"awaiting: {', '.join(results.awaiting)}")
    return lines


def survey_records_lines(results: SurveyResults, url: str) -> list[str]:
    """The pooled records of each group in lines, for `study show` of a survey study at coordinator `url`."""
    sites = [reported.site for reported in results.sites]
    lines = [f"survey: {len(sites)} site(s) reported" + (f" ({', '.join(sites)})" if sites else "")]
    if sites:
        cells = _cells(results)
        pooled = [
            f"{group} {pool(c[(group, 'records', 'records')] for c in cells.values()).text()}" for group in GROUPS
        ]
        lines.append("  records pooled: " + ", ".join(pooled))
    if results.awaiting:
        lines.append(f"  awaiting: {', '.join(results.awaiting)}")
    lines.append(f"  the tables: cardiofl study survey {results.study_id} --url {shlex.quote(url)}")
    return lines
