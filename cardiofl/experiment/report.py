"""An experiment's report: Table I (Markdown and CSV), the paper's claims, the Fig. 2 head-ratio deltas, curves.

This module only composes; the parts live in their own modules, each importing only those before it:

    results  (read the runner's JSON-lines file, aggregate over seeds)
      -> tables   (Table I in Markdown and CSV, notes, learned heads' effective heads)
      -> claims   (the paper's direction and learned heads' claim against the seeds' spread)
    results -> figures  (curves.png, head_ratio_deltas.png, gates.png)
    all of them -> report

table.md holds Table I, then the paper's direction, then for learned head assignment the
effective number of local heads and its claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cardiofl.experiment.claims import direction, learned_claim
from cardiofl.experiment.figures import plot_curves, plot_gates, plot_ratio_deltas
from cardiofl.experiment.results import read_results, table_rows
from cardiofl.experiment.tables import effective_heads_table, global_note, markdown_tables, privacy_note, write_csv

__all__ = ["write_report"]


def write_report(results: Path, out_dir: Path, *, sites: Sequence[str] | None = None) -> dict[str, Path]:
    """Write table.md, table.csv, curves.png, head_ratio_deltas.png and gates.png; `sites` orders the site columns."""
    runs = read_results(results)
    if not runs:
        raise ValueError(f"{results} holds no finished run")
    out_dir.mkdir(parents=True, exist_ok=True)
    site_names, columns, rows = table_rows(runs, sites)
    written = {
        "table.md": out_dir / "table.md",
        "table.csv": out_dir / "table.csv",
        "curves.png": out_dir / "curves.png",
    }
    notes = global_note(runs) + privacy_note(runs)
    learned = effective_heads_table(runs, site_names) + learned_claim(runs, sites)
    written["table.md"].write_text(markdown_tables(site_names, columns, rows, notes) + direction(runs, sites) + learned)
    write_csv(written["table.csv"], columns, rows)
    plot_curves(written["curves.png"], runs)
    if plot_ratio_deltas(out_dir / "head_ratio_deltas.png", runs, site_names):
        written["head_ratio_deltas.png"] = out_dir / "head_ratio_deltas.png"
    if plot_gates(out_dir / "gates.png", runs, site_names):
        written["gates.png"] = out_dir / "gates.png"
    return written
