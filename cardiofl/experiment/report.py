"""Reports of an experiment's results: Table I (Markdown and CSV), the Fig. 2 head-ratio deltas, learning curves.

Per-site numbers are each site's personalised model (theta^g_T with its phi_k) on its own test
split, and Global is the global evaluation model theta^g_T with phi_0 pooled over every site's test
split, both from the final evaluation round; mean ± std over seeds (sample std, n-1), in percent.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.model import head_ratios

__all__ = ["FinalMetrics", "read_results", "write_report"]

METRICS = (("micro_f1", "F1"), ("map", "mAP"))


@dataclass(frozen=True)
class FinalMetrics:
    """One finished run's final numbers and its per-round curve."""

    method: str
    heads: str
    seed: int
    sites: dict[str, dict[str, float | None]]  # site -> personalised summary
    global_: dict[str, float | None]  # pooled theta^g_T
    curve: list[tuple[int, dict[str, float | None]]]  # (t, pooled summary of theta^g_t)
    site_curves: dict[str, list[tuple[int, dict[str, float | None]]]]  # site -> (t, personalised after round t)


def read_results(path: Path) -> list[FinalMetrics]:
    """The finished runs in a results file (the last finished attempt of each run)."""
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    finished: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record["type"] == "round":
            rounds[record["attempt"]].append(record)
        elif record["type"] == "run_done":
            finished[record["run"]] = record["attempt"]
    runs = []
    for attempt in finished.values():
        records = sorted(rounds[attempt], key=lambda r: r["round"])
        final = records[-1]
        if final["kind"] != "evaluate":
            continue
        # theta^g_t is evaluated by the sites in round t+1 (or the final evaluation round)
        curve = [(r["round"] - 1, r["previous_global"]) for r in records if r["round"] > 1 and r["previous_global"]]
        site_curves: dict[str, list[tuple[int, dict[str, float | None]]]] = defaultdict(list)
        for r in records:
            if r["kind"] == "train":
                for site, values in r["sites"].items():
                    if values["local"]:
                        site_curves[site].append((r["round"], values["local"]))
        runs.append(
            FinalMetrics(
                method=final["method"],
                heads=final["heads"],
                seed=final["seed"],
                sites={site: values["local"] for site, values in final["sites"].items()},
                global_=final["previous_global"],
                curve=curve,
                site_curves=dict(site_curves),
            )
        )
    return runs


def _value(summary: dict[str, float | None] | None, metric: str) -> float | None:
    value = (summary or {}).get(metric)
    return None if value is None else 100.0 * value


def _mean_std(values: list[float | None]) -> tuple[float, float] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0


def _table(runs: list[FinalMetrics]) -> tuple[list[str], list[tuple[str, str]], dict[tuple[str, str], dict[str, Any]]]:
    sites = sorted({site for run in runs for site in run.sites})
    columns = [(site, metric) for site in sites for metric, _ in METRICS] + [("Global", m) for m, _ in METRICS]
    order = {ratio: i for i, ratio in enumerate(head_ratios(8))}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    grouped: dict[tuple[str, str], list[FinalMetrics]] = defaultdict(list)
    for run in runs:
        grouped[(run.method, run.heads)].append(run)
    for key in sorted(grouped, key=lambda k: (k[0], order.get(k[1], 99), k[1])):
        group = grouped[key]
        cells = {}
        for site, metric in columns:
            values = [_value(r.global_ if site == "Global" else r.sites.get(site), metric) for r in group]
            cells[f"{site}:{metric}"] = _mean_std(values)
        cells["seeds"] = len(group)
        rows[key] = cells
    return sites, columns, rows


def _markdown(sites: list[str], columns: list[tuple[str, str]], rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    best: dict[str, float] = {}
    for site, metric in columns:
        values = [cells[f"{site}:{metric}"][0] for cells in rows.values() if cells[f"{site}:{metric}"] is not None]
        if values:
            best[f"{site}:{metric}"] = max(values)
    header = [
        "Method",
        "H_g:H_l",
        *(f"{site} {label}" for site, metric in columns for m, label in METRICS if m == metric),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (method, heads), cells in rows.items():
        out = [method, heads]
        for site, metric in columns:
            value = cells[f"{site}:{metric}"]
            if value is None:
                out.append("–")
                continue
            text = f"{value[0]:.1f}±{value[1]:.1f}"
            out.append(f"**{text}**" if abs(value[0] - best[f"{site}:{metric}"]) < 1e-9 else text)
        lines.append("| " + " | ".join(out) + " |")
    note = (
        "\nPer-site: each site's personalised model on its own test split; Global: theta^g_T with phi_0 pooled "
        "over all sites' test splits; % mean±std over seeds; bold = best. Sites: " + ", ".join(sites) + ".\n"
    )
    return "\n".join(lines) + "\n" + note


def _csv(path: Path, columns: list[tuple[str, str]], rows: dict[tuple[str, str], dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["method", "heads", "seeds", *(f"{s}_{m}_{stat}" for s, m in columns for stat in ("mean", "std"))]
        )
        for (method, heads), cells in rows.items():
            values = []
            for site, metric in columns:
                value = cells[f"{site}:{metric}"]
                values += [f"{value[0]:.4f}", f"{value[1]:.4f}"] if value else ["", ""]
            writer.writerow([method, heads, cells["seeds"], *values])


def _plot_ratio_deltas(path: Path, runs: list[FinalMetrics], sites: list[str]) -> bool:
    """Fig. 2: per-site and global F1/mAP minus the 8:0 run, across the head splits (FedDualAtt runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [r for r in head_ratios(8) if any(run.heads == r for run in runs)]
    if "8:0" not in ratios or len(ratios) < 2:
        return False
    method = next(run.method for run in runs if run.heads == "8:0")
    chosen = [run for run in runs if run.method == method]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for axis, (metric, label) in zip(axes, METRICS, strict=True):
        for who in [*sites, "Global"]:
            means = {}
            for ratio in ratios:
                values = [
                    _value(run.global_ if who == "Global" else run.sites.get(who), metric)
                    for run in chosen
                    if run.heads == ratio
                ]
                stats = _mean_std(values)
                if stats is not None:
                    means[ratio] = stats[0]
            if "8:0" not in means:
                continue
            xs = [i for i, r in enumerate(ratios) if r in means]
            ys = [means[ratios[i]] - means["8:0"] for i in xs]
            style = {"linestyle": "--", "color": "purple", "linewidth": 2.5} if who == "Global" else {}
            axis.plot(xs, ys, marker="o", label=who, **style)
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.set_xticks(range(len(ratios)), [f"{r.split(':')[0]}g:{r.split(':')[1]}l" for r in ratios], rotation=45)
        axis.set_ylabel(f"{label} delta vs 8:0 (pp)")
        axis.set_title(f"{method}: {label}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_curves(path: Path, runs: list[FinalMetrics]) -> None:
    """Learning curves: pooled global micro-F1 and mAP of theta^g_t per round, one line per method and split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    grouped: dict[tuple[str, str], list[FinalMetrics]] = defaultdict(list)
    for run in runs:
        grouped[(run.method, run.heads)].append(run)
    for (method, heads), group in sorted(grouped.items()):
        for axis, (metric, label) in zip(axes, METRICS, strict=True):
            by_round: dict[int, list[float | None]] = defaultdict(list)
            for run in group:
                for t, summary in run.curve:
                    by_round[t].append(_value(summary, metric))
            points = [(t, _mean_std(v)) for t, v in sorted(by_round.items())]
            xs = [t for t, s in points if s is not None]
            ys = [s[0] for _, s in points if s is not None]
            axis.plot(xs, ys, marker=".", label=f"{method} {heads}")
            axis.set_xlabel("round")
            axis.set_ylabel(f"global {label} (%)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: Path, out_dir: Path) -> dict[str, Path]:
    """Write table.md, table.csv, head_ratio_deltas.png (when 8:0 and another split ran) and curves.png."""
    runs = read_results(results)
    if not runs:
        raise ValueError(f"{results} holds no finished run")
    out_dir.mkdir(parents=True, exist_ok=True)
    sites, columns, rows = _table(runs)
    written = {
        "table.md": out_dir / "table.md",
        "table.csv": out_dir / "table.csv",
        "curves.png": out_dir / "curves.png",
    }
    written["table.md"].write_text(_markdown(sites, columns, rows))
    _csv(written["table.csv"], columns, rows)
    _plot_curves(written["curves.png"], runs)
    if _plot_ratio_deltas(out_dir / "head_ratio_deltas.png", runs, sites):
        written["head_ratio_deltas.png"] = out_dir / "head_ratio_deltas.png"
    return written
