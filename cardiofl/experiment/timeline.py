"""Readings against simulated wall-clock time: the slowest site's and the others' as each method releases theta^g_t.

For experiments with `site_readings` (each released theta^g_t read with phi_0 on every training site's
test split) on the clock of `site_seconds`: the slowest site is the one with the most simulated seconds
per round. `timeline_figure` plots its mAP and micro-F1, and the other sites' mean, against the clock
(mean over seeds at each release: a method's clock is the same for every seed); `timeline_table` gives
each method's clock at its last release and the readings there, mean ± std over seeds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import TYPE_CHECKING

from cardiofl.experiment.results import METRICS, FinalMetrics, mean_std, percent

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["slowest_site", "timeline_figure", "timeline_table"]

Reading = dict[str, float | None]


def slowest_site(runs: list[FinalMetrics]) -> str | None:
    """The site with the most simulated seconds per round, when the runs hold a timeline and a slower site."""
    seconds = _site_seconds(runs)
    return max(sorted(seconds), key=lambda site: seconds[site]) if seconds else None


def _site_seconds(runs: list[FinalMetrics]) -> dict[str, float]:
    """The experiment's site_seconds, as the runs with a timeline recorded them (none: {})."""
    return next((run.site_seconds for run in runs if run.timeline and run.site_seconds), {})


OTHERS = "the other sites (mean)"


def _readings(run: FinalMetrics, slow: str) -> list[tuple[float, dict[str, Reading]]]:
    """(clock, {the slow site: its reading, OTHERS: the other sites' mean reading}) at each release of `run`."""
    out = []
    for clock, by_site in run.timeline:
        others = [summary for site, summary in by_site.items() if site != slow]
        mean = {
            metric: statistics.fmean(v for s in others if (v := s.get(metric)) is not None) if others else None
            for metric, _ in METRICS
        }
        out.append((clock, {slow: by_site.get(slow) or {}, OTHERS: mean}))
    return out


def _by_method(runs: list[FinalMetrics]) -> dict[str, list[FinalMetrics]]:
    grouped: dict[str, list[FinalMetrics]] = defaultdict(list)
    for run in runs:
        if run.timeline:
            grouped[run.method].append(run)
    return dict(grouped)


def timeline_figure(runs: list[FinalMetrics]) -> Figure | None:
    """MAP and micro-F1 of theta^g_t on the slowest site and the others' mean, against the simulated clock."""
    slow = slowest_site(runs)
    if slow is None:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 7))
    grid = figure.subplots(2, 2, sharex=True, squeeze=False)
    for method, group in sorted(_by_method(runs).items()):
        series = [_readings(run, slow) for run in group]
        for row, (metric, label) in enumerate(reversed(METRICS)):  # mAP first
            for column, who in enumerate((slow, OTHERS)):
                points = []
                for index in range(min(len(s) for s in series)):
                    clock = statistics.fmean(s[index][0] for s in series)
                    cell = mean_std([percent(s[index][1][who], metric) for s in series])
                    if cell is not None:
                        points.append((clock, cell[0]))
                axis = grid[row][column]
                axis.plot([x for x, _ in points], [y for _, y in points], marker=".", label=method)
                axis.set_title(f"{label} of θ^g_t on {who}", fontsize=9)
                axis.set_ylabel(f"{label} (%)")
                if row == 1:
                    axis.set_xlabel("simulated wall-clock time (s)")
    grid[0][0].legend(fontsize=7)
    figure.tight_layout()
    return figure


def timeline_table(runs: list[FinalMetrics]) -> str:
    """Markdown: each method's clock at its last release, and its readings there on the slowest site and the rest."""
    slow = slowest_site(runs)
    if slow is None:
        return ""
    lines = [
        f"\n## Against simulated time (slowest site: {slow}, {_site_seconds(runs)[slow]:g} s a round)\n",
        "| method | releases | clock at the last (s) | "
        + " | ".join(f"{slow} {label} | others {label}" for _, label in METRICS)
        + " |",
        "| --- | ---: | ---: | " + " | ".join("---: | ---:" for _ in METRICS) + " |",
    ]
    for method, group in sorted(_by_method(runs).items()):
        last = [_readings(run, slow)[-1] for run in group]
        cells = []
        for metric, _ in METRICS:
            for who in (slow, OTHERS):
                cell = mean_std([percent(readings[who], metric) for _, readings in last])
                cells.append("–" if cell is None else f"{cell[0]:.1f} ± {cell[1]:.1f}")
        clock = statistics.fmean(clock for clock, _ in last)
        lines.append(f"| {method} | {len(group[0].timeline)} | {clock:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
