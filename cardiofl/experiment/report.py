"""An experiment's report: Table I (Markdown and CSV), the paper's claims, the Fig. 2 head-ratio deltas, curves.

This module only composes; the parts live in their own modules, each importing only those before it:

    results  (read the runner's JSON-lines file, aggregate over seeds)
      -> tables   (Table I in Markdown and CSV, notes, learned heads' effective heads)
      -> claims   (the paper's direction and learned heads' claim against the seeds' spread)
    results -> figures  (curves.png, head_ratio_deltas.png, gates.png, local_vs_federated.png)
    results -> timeline (timeline.png and its table: readings against simulated time, with site_readings)
    all of them -> report

table.md holds Table I, then the paper's direction, then for learned head assignment the
effective number of local heads and its claim, then, for runs with validation sites, the external
validation. Runs of the local baseline (each site trained alone) are rows of Table I and bars of
local_vs_federated.png; the paper's direction, learned heads' claim and the head-ratio deltas read the
federated runs alone. `build_report` returns it all as a `Report` of objects (text, rows, matplotlib
Figures) for a notebook; `write_report`, what the CLI calls, saves that same report as files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cardiofl.experiment.claims import direction, learned_claim
from cardiofl.experiment.figures import curves_figure, gates_figure, local_vs_federated_figure, ratio_deltas_figure
from cardiofl.experiment.results import Columns, FinalMetrics, Rows, federated, read_results, table_rows
from cardiofl.experiment.tables import (
    csv_text,
    effective_heads_table,
    external_table,
    global_note,
    markdown_tables,
    privacy_note,
)
from cardiofl.experiment.timeline import timeline_figure, timeline_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Report", "build_report", "write_report"]

PNG_DPI = 120


@dataclass(frozen=True)
class Report:
    """An experiment's report as objects: a notebook shows them, `save` writes the files the CLI writes."""

    runs: list[FinalMetrics]  # every finished run, as read from the results file
    sites: list[str]  # the site columns, in order
    columns: Columns
    rows: Rows  # Table I: (method, heads) -> its cells
    markdown: str  # table.md: Table I, the paper's direction, learned heads' effective heads and claim
    figures: dict[str, Figure]  # "curves", and where the runs allow "head_ratio_deltas", "gates", "local_vs_federated",
    # "timeline"

    @property
    def csv(self) -> str:
        """table.csv's text."""
        return csv_text(self.columns, self.rows)

    def _repr_markdown_(self) -> str:
        """What Jupyter shows for the report itself: Table I and its claims."""
        return self.markdown

    def save(self, out_dir: Path) -> dict[str, Path]:
        """Write table.md, table.csv and each figure as <name>.png into `out_dir`; return the paths by file name."""
        out_dir.mkdir(parents=True, exist_ok=True)
        written = {"table.md": out_dir / "table.md", "table.csv": out_dir / "table.csv"}
        written["table.md"].write_text(self.markdown)
        written["table.csv"].write_text(self.csv, newline="")
        for name, figure in self.figures.items():
            path = written[f"{name}.png"] = out_dir / f"{name}.png"
            figure.savefig(path, dpi=PNG_DPI)
        return written


def build_report(results: Path, *, sites: Sequence[str] | None = None) -> Report:
    """The report of a results file (the runner's JSON lines); `sites` orders the site columns."""
    runs = read_results(results)
    if not runs:
        raise ValueError(f"{results} holds no finished run")
    site_names, columns, rows = table_rows(runs, sites)
    notes = global_note(runs) + privacy_note(runs)
    shared = federated(runs)  # the runs of the local baseline have no theta^g nor head split to judge
    learned = effective_heads_table(runs, site_names) + learned_claim(shared, sites)
    markdown = markdown_tables(site_names, columns, rows, notes) + direction(shared, sites) + learned
    markdown += external_table(runs) + timeline_table(runs)
    figures = {"curves": curves_figure(runs)}
    for name, figure in (
        ("head_ratio_deltas", ratio_deltas_figure(shared, site_names)),
        ("gates", gates_figure(runs, site_names)),
        ("local_vs_federated", local_vs_federated_figure(runs, site_names)),
        ("timeline", timeline_figure(runs)),
    ):
        if figure is not None:
            figures[name] = figure
    return Report(runs, site_names, columns, rows, markdown, figures)


def write_report(results: Path, out_dir: Path, *, sites: Sequence[str] | None = None) -> dict[str, Path]:
    """Write table.md, table.csv and the figures' PNGs (curves.png ...); `sites` orders the site columns."""
    return build_report(results, sites=sites).save(out_dir)
