"""The report's figures as matplotlib Figure objects: learning curves, Fig. 2's head-ratio deltas, learned gates.

curves: the pooled global micro-F1 and mAP of theta^g_t per round, one line per method and split.
head_ratio_deltas: per-site and Global F1/mAP minus 8:0's across the head splits. gates: for runs
of learned head assignment, each site's gates per round (mean over seeds). local_vs_federated:
DataTools4Heart's Fig. 2, each site's own model trained alone (the local baseline) against its
model under each federated method, as grouped bars.

Each function returns a `matplotlib.figure.Figure` made without pyplot, so it touches no global
state and forces no backend: a notebook shows it inline, and `Report.save` (report.py) writes it
as a PNG headless with `figure.savefig`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from cardiofl.experiment.results import BASELINE, METRICS, FinalMetrics, by_row, mean_std, percent, trained_alone
from shared.algorithms.exchange import GLOBAL
from shared.model.network import head_ratios

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from numpy.typing import NDArray

__all__ = [
    "SITE_METRICS",
    "curves_figure",
    "gates_figure",
    "local_vs_federated_figure",
    "ratio_deltas_figure",
    "site_metric",
]

# local_vs_federated's metric: the first of these the sites' summaries hold
SITE_METRICS = (("macro_auroc", "macro AUROC"), ("micro_f1", "micro-F1"))


def _figure(
    rows: int, columns: int, *, figsize: tuple[float, float], sharex: bool = False, sharey: bool = False
) -> tuple[Figure, NDArray[Any]]:
    """A fresh Figure and its grid of axes (always 2-D), owned by no pyplot state."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize)
    return figure, figure.subplots(rows, columns, sharex=sharex, sharey=sharey, squeeze=False)


def gates_figure(runs: list[FinalMetrics], sites: list[str]) -> Figure | None:
    """Each site's learned gates per round, mean over seeds: a panel per (method, block) and site, a line per head."""
    from matplotlib import colormaps

    learned = [run for run in runs if run.gate_curves]
    if not learned:
        return None
    methods = list(dict.fromkeys(run.method for run in learned))
    panels = [site for site in sites if any(site in run.gate_curves for run in learned)]
    blocks = max(len(gates) for run in learned for curve in run.gate_curves.values() for _, gates in curve)
    rows = [(method, b) for method in methods for b in range(blocks)]
    fig, axes = _figure(len(rows), len(panels), figsize=(3.6 * len(panels) + 1.4, 2.8 * len(rows)), sharey=True)
    colours = colormaps["tab10"]
    for row, (method, b) in zip(axes, rows, strict=True):
        chosen = [run for run in learned if run.method == method]
        for axis, site in zip(row, panels, strict=True):
            by_round: dict[int, list[list[float]]] = defaultdict(list)  # t -> each seed's gates of block b
            for run in chosen:
                for t, gates in run.gate_curves.get(site, []):
                    by_round[t].append(gates[b])
            rounds = sorted(by_round)
            for h in range(len(by_round[rounds[0]][0]) if rounds else 0):
                ys = [statistics.fmean(seed[h] for seed in by_round[t]) for t in rounds]
                axis.plot(rounds, ys, marker="o", markersize=3, color=colours(h % 10), label=f"head {h}")
            seeds = len({run.seed for run in chosen if site in run.gate_curves})
            axis.set_title(f"{method}: {site}, block {b} ({seeds} seeds)", fontsize=9)
            axis.set_ylim(-0.05, 1.05)
            axis.set_xticks(rounds)
        row[0].set_ylabel("gate g (1 local, 0 global)")
    for axis in axes[-1]:
        axis.set_xlabel("round")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def ratio_deltas_figure(runs: list[FinalMetrics], sites: list[str]) -> Figure | None:
    """Fig. 2: per-site and global F1/mAP minus the 8:0 run, across the head splits (FedDualAtt runs)."""
    ratios = [r for r in head_ratios(8) if any(run.heads == r for run in runs)]
    if BASELINE not in ratios or len(ratios) < 2:
        return None
    method = next(run.method for run in runs if run.heads == BASELINE)
    chosen = [run for run in runs if run.method == method]
    fig, grid = _figure(1, 2, figsize=(11, 4), sharex=True)
    axes = grid[0]
    for axis, (metric, label) in zip(axes, METRICS, strict=True):
        for who in [*sites, GLOBAL]:
            means = {}
            for ratio in ratios:
                stats = mean_std([percent(run.summary(who), metric) for run in chosen if run.heads == ratio])
                if stats is not None:
                    means[ratio] = stats[0]
            if BASELINE not in means:
                continue
            xs = [i for i, r in enumerate(ratios) if r in means]
            ys = [means[ratios[i]] - means[BASELINE] for i in xs]
            style = {"linestyle": "--", "color": "purple", "linewidth": 2.5} if who == GLOBAL else {}
            axis.plot(xs, ys, marker="o", label=who, **style)
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.set_xticks(range(len(ratios)), [f"{r.split(':')[0]}g:{r.split(':')[1]}l" for r in ratios], rotation=45)
        axis.set_ylabel(f"{label} delta vs {BASELINE} (pp)")
        axis.set_title(f"{method}: {label}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def curves_figure(runs: list[FinalMetrics]) -> Figure:
    """Learning curves: pooled global micro-F1 and mAP of theta^g_t per round, one line per method and split."""
    fig, grid = _figure(1, 2, figsize=(11, 4))
    axes = grid[0]
    for (method, heads), group in sorted(by_row(runs).items()):
        for axis, (metric, label) in zip(axes, METRICS, strict=True):
            by_round: dict[int, list[float | None]] = defaultdict(list)
            for run in group:
                for t, summary in run.curve:
                    by_round[t].append(percent(summary, metric))
            points = [(t, mean_std(v)) for t, v in sorted(by_round.items())]
            xs = [t for t, s in points if s is not None]
            ys = [s[0] for _, s in points if s is not None]
            axis.plot(xs, ys, marker=".", label=f"{method} {heads}")
            axis.set_xlabel("round")
            axis.set_ylabel(f"global {label} (%)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def site_metric(runs: list[FinalMetrics], sites: list[str]) -> tuple[str, str]:
    """(summary key, label) of the per-site metric: macro AUROC where the sites' summaries hold it, else micro-F1."""
    for metric, label in SITE_METRICS:
        if any(percent(run.sites.get(site), metric) is not None for run in runs for site in sites):
            return metric, label
    return SITE_METRICS[-1]


def _compared_rows(runs: list[FinalMetrics]) -> list[tuple[str, str]]:
    """The bars at each site: the local baseline's rows, then each federated method at the same splits, else at all."""
    grouped = by_row(runs)
    alone = [key for key, group in grouped.items() if trained_alone(group[0])]
    splits = {heads for _, heads in alone}
    shared = [key for key in grouped if key not in alone]
    rows = list(alone)
    for method in dict.fromkeys(method for method, _ in shared):
        mine = [key for key in shared if key[0] == method]
        rows += [key for key in mine if key[1] in splits] or mine
    return rows if alone and shared else []


def local_vs_federated_figure(runs: list[FinalMetrics], sites: list[str]) -> Figure | None:
    """DataTools4Heart Fig. 2: at each site, its model trained alone against its federated models, mean ± std."""
    rows = _compared_rows(runs)
    if not rows:
        return None
    grouped = by_row(runs)
    metric, label = site_metric([run for key in rows for run in grouped[key]], sites)
    fig, grid = _figure(1, 1, figsize=(3.5 + len(sites) * (0.6 + 0.3 * len(rows)), 4.2))
    axis, width = grid[0][0], 0.8 / len(rows)
    for i, key in enumerate(rows):
        alone = trained_alone(grouped[key][0])
        cells = [mean_std([percent(run.sites.get(site), metric) for run in grouped[key]]) for site in sites]
        bars = [(s + (i - (len(rows) - 1) / 2) * width, cell) for s, cell in enumerate(cells) if cell is not None]
        style = {"color": "lightgrey", "edgecolor": "black", "hatch": "//"} if alone else {}
        axis.bar(
            [x for x, _ in bars],
            [cell[0] for _, cell in bars],
            width,
            yerr=[cell[1] for _, cell in bars],
            capsize=3,
            label=f"{key[0]} {key[1]}" + (" (trained alone)" if alone else ""),
            **style,
        )
    axis.set_xticks(range(len(sites)), sites)
    axis.set_ylabel(f"{label} (%), mean ± std over seeds")
    axis.set_title(f"Each site's model: {label}, trained alone vs federated", fontsize=10)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
