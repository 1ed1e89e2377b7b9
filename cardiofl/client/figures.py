"""A study's figures as `cardiofl study show` and `study watch` print them (docs/researcher/metrics.md).

Each figure is written by `shared.wire.metrics.figure_text`: three decimals, then `±bound` where it
was pooled from histograms (the most the binning can move it), then its 95% interval where the
summary has one: "0.812±0.004 (0.771–0.853)"; a dash where there is no figure. The tables (rich) keep to
120 columns: per round one metric for each site's personalised model and the pooled global model
(`round_table`), the clinical figures of the global model per round (`global_table`), and those of
each site's personalised model in the latest round that reported them (`sites_table`), with their
bootstrap intervals. `watch_lines` says the same of one settled round in two lines.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.evaluation.figure_names import CLINICAL_METRICS
from shared.tables import Table
from shared.wire.api import RoundPublic, UpdatePublic
from shared.wire.metrics import MetricSummary, PooledMetrics, figure_text

__all__ = [
    "CLINICAL_LABELS",
    "METRIC_NAMES",
    "clinical_tables",
    "clinical_text",
    "fmt",
    "global_table",
    "has_clinical",
    "round_table",
    "sites_table",
    "watch_lines",
]

_SHORT = {
    "macro_auroc": "macro-AUROC",
    "balanced_accuracy": "bal. acc.",
    "sensitivity": "sens.",
    "specificity": "spec.",
}
CLINICAL_LABELS = {name: _SHORT.get(name, name.upper()) for name in CLINICAL_METRICS}  # column titles, in order
METRIC_NAMES = {"micro_f1": "micro-F1", "map": "mAP", **CLINICAL_LABELS}
_INTERVALS = {"macro_auroc", "balanced_accuracy", "ece"}  # the clinical figures the tables show with their interval
_BOUND_NOTE = "±: the most the histograms' binning can move it; (…): 95% interval"  # of a pooled figure


def fmt(value: float | bool | None) -> str:
    """A metric with three decimals, or a dash when there is none."""
    return "–" if value is None else f"{value:.3f}"


def has_clinical(summary: MetricSummary | None) -> bool:
    """Whether `summary` holds any clinical figure (sites below privacy.min_records send none)."""
    return any(getattr(summary, name, None) is not None for name in CLINICAL_METRICS)


def clinical_text(summary: MetricSummary | None, intervals: Sequence[str] = ("macro_auroc",)) -> str:
    """The clinical figures in one line: "macro-AUROC 0.812±0.004 (0.771–0.853), bal. acc. 0.701, ..."."""
    return ", ".join(
        f"{label} {figure_text(summary, name, interval=name in intervals)}" for name, label in CLINICAL_LABELS.items()
    )


def _local(update: UpdatePublic | None, metric: str) -> str:
    """The site's personalised figure; in a buffered study, with τ when its update trained from an older version."""
    local = update.local_eval if update else None
    late = f" (τ{update.staleness})" if update is not None and update.staleness else ""
    return (fmt(getattr(local, metric, None)) if local else "–") + late


def _label(r: RoundPublic) -> str:
    label = "final eval" if r.kind == "evaluate" else str(r.number)
    return label + (f" (try {r.attempt})" if r.attempt > 1 else "")


def round_table(rounds: Sequence[RoundPublic], metric: str = "micro_f1", title: str | None = None) -> Table:
    """Per round, one metric: each site's personalised model, and the global model theta^g_t pooled."""
    sites = sorted({u.site for r in rounds for u in r.updates})
    table = Table(
        "round",
        "status",
        "train loss",
        *sites,
        "global",
        title=title or f"{METRIC_NAMES.get(metric, metric)}: sites' personalised models, and the global model (pooled)",
        caption=_BOUND_NOTE if metric in CLINICAL_LABELS else None,
    )
    for r in rounds:
        by_site = {u.site: u for u in r.updates}
        pooled = r.pooled or PooledMetrics()
        table.add_row(
            _label(r),
            r.status,
            "–" if r.kind == "evaluate" else fmt(pooled.train_loss),
            *(_local(by_site.get(site), metric) for site in sites),
            figure_text(pooled.eval, metric),
        )
    return table


def _clinical_cells(summary: MetricSummary | None) -> list[str]:
    return [figure_text(summary, name, interval=name in _INTERVALS) for name in CLINICAL_LABELS]


def global_table(rounds: Sequence[RoundPublic]) -> Table | None:
    """Per round, the clinical figures of its global model theta^g_t pooled over the sites; None without any."""
    pooled = [(r, r.pooled.eval) for r in rounds if r.pooled is not None and has_clinical(r.pooled.eval)]
    if not pooled:
        return None
    table = Table(
        "round",
        "records",
        *CLINICAL_LABELS.values(),
        title="Clinical figures of the global model theta^g_t, pooled over the sites' test splits",
        caption=f"{_BOUND_NOTE}, DeLong's or Wilson's",
    )
    for r, summary in pooled:
        table.add_row(_label(r), str(summary.n_samples if summary else "–"), *_clinical_cells(summary))
    return table


def sites_table(rounds: Sequence[RoundPublic]) -> Table | None:
    """The clinical figures of each site's personalised model in the latest round that reported any, and their mean."""
    reported = [r for r in rounds if any(has_clinical(u.local_eval) for u in r.updates)]
    if not reported:
        return None
    latest = max(reported, key=lambda r: (r.number, r.attempt))
    table = Table(
        "site",
        "records",
        *CLINICAL_LABELS.values(),
        title="Clinical figures of the sites' personalised models, "
        + ("in the final evaluation" if latest.kind == "evaluate" else f"round {_label(latest)}"),
        caption="(…): each site's 95% bootstrap interval; the mean over sites, weighted by records, has none",
    )
    for update in sorted(latest.updates, key=lambda u: u.site):
        local = update.local_eval
        table.add_row(update.site, str(local.n_samples if local else "–"), *_clinical_cells(local))
    mean = latest.pooled.local_eval if latest.pooled else None
    if mean is not None:
        table.add_row("mean", str(mean.n_samples), *_clinical_cells(mean), style="bold")
    return table


def clinical_tables(rounds: Sequence[RoundPublic]) -> list[Table]:
    """What `study show` prints after micro-F1 and mAP, where any clinical figure was reported.

    Macro-AUROC per round, the global model's clinical figures per round, and the sites' in the latest round.
    """
    tables = [global_table(rounds), sites_table(rounds)]
    if not any(tables):
        return []
    return [round_table(rounds, "macro_auroc"), *(table for table in tables if table is not None)]


def watch_lines(round_: RoundPublic, earlier: RoundPublic | None = None) -> list[str]:
    """A settled round in a line, then the clinical figures of its personalised models (mean) and of a global model.

    The global model theta^g_t of round t is read in round t + 1: `earlier` is round t when `round_` is t + 1.
    """
    pooled = round_.pooled or PooledMetrics()
    loss = f", train loss {fmt(pooled.train_loss)}" if round_.kind == "train" else ""
    lines = [
        f"round {round_.number} ({round_.kind}, attempt {round_.attempt}) {round_.status}: "
        f"{len(round_.updates)} sites{loss}"
    ]
    if has_clinical(pooled.local_eval):
        lines.append(f"  personalised (mean): {clinical_text(pooled.local_eval, ())}")
    glob = earlier.pooled.eval if earlier is not None and earlier.pooled is not None else None
    if earlier is not None and has_clinical(glob):
        lines.append(f"  theta^g_{earlier.number} pooled: {clinical_text(glob)}")
    return lines
