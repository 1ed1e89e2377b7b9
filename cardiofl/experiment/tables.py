"""Table I of an experiment's results in Markdown and CSV, with its notes and the learned heads' effective heads.

In each column of each table the best mean is bold and the second-best underlined, ranked by the
mean as printed (0.1 %), so equal printed means share a mark and the next lower mean is
second-best. A dagger follows the best when its lead over the second-best is within the seeds'
spread (their mean ± std ranges overlap): no clear winner. Rows on plain ResNet1D-34 (head split
"-") and rows on the hybrid model are two labelled tables when both are present, ranked together.

The notes say when an experiment lowered the study's privacy.min_records, when Global lacks a site
below it, which methods' Global takes each site's own BatchNorm, and which methods shared nothing.
Runs with validation sites add the external validation table (`external_table`), ranked the same way.
"""

from __future__ import annotations

import csv
import io
import re

from cardiofl.experiment.readings import PHI_K_AVERAGED
from cardiofl.experiment.results import (
    CLINICAL_COLUMNS,
    DEFAULT_MIN_RECORDS,
    TABLE_METRICS,
    Cell,
    Columns,
    FinalMetrics,
    Rows,
    effective_heads,
    external_rows,
    federated,
    trained_alone,
)
from shared.algorithms.exchange import GLOBAL, OWN_MODELS
from shared.model.network import NO_HEADS

__all__ = [
    "BEST",
    "SECOND",
    "WITHIN_SPREAD",
    "effective_heads_table",
    "external_table",
    "global_note",
    "markdown_tables",
    "privacy_note",
    "ranks",
    "shown",
    "csv_text",
]

BEST, SECOND = "best", "second"
WITHIN_SPREAD = "†"  # after a best whose lead over the second-best is within the seeds' spread


def privacy_note(runs: list[FinalMetrics]) -> str:
    """What the pooled Global metrics left out, and a minimum of records lowered below the default."""
    said = []
    lowered = sorted({run.min_records for run in runs if run.min_records < DEFAULT_MIN_RECORDS})
    if lowered:
        minimum = ", ".join(str(m) for m in lowered)
        said.append(
            f"Sites sent counts and histograms for Global from {minimum} test records on, lowered from the "
            f"default minimum of {DEFAULT_MIN_RECORDS} (privacy.min_records) for this small data set."
        )
    left_out = sorted({site for run in runs for site in run.too_few})
    if left_out:
        said.append(
            "Global lacks the test records of " + ", ".join(left_out) + " (too few records) in some or all runs."
        )
    return "".join(f"{line}\n" for line in said)


def global_note(runs: list[FinalMetrics]) -> str:
    """Which methods' Global model takes each site's own BatchNorm, and which have no theta^g (the local baseline)."""
    said = ""
    shared = federated(runs)
    site_batchnorm = sorted({run.method for run in shared if run.global_label != GLOBAL})
    if site_batchnorm:
        labels = sorted({run.global_label for run in shared if run.global_label != GLOBAL})
        said += (
            f"{', '.join(labels)}: for {', '.join(site_batchnorm)}, whose BatchNorm stays at the sites, each site "
            "evaluated theta^g_T with its own trained BatchNorm (phi_0's are untrained).\n"
        )
    alone = sorted({run.method for run in runs if trained_alone(run)})
    if alone:
        said += (
            f"{OWN_MODELS}: {', '.join(alone)} shared nothing (each site trained alone), so there is no theta^g_T: "
            "its Global is each site's own model on its own test split, pooled as Global is, "
            f"without {PHI_K_AVERAGED}.\n"
        )
    return said


def shown(value: tuple[float, float]) -> tuple[float, float]:
    """A cell's mean and std as the table prints them."""
    return float(f"{value[0]:.1f}"), float(f"{value[1]:.1f}")


def ranks(values: list[Cell]) -> tuple[list[str], bool]:
    """One column's marks (BEST, SECOND or "") and whether the best's lead is within the seeds' spread."""
    printed = [None if value is None else shown(value) for value in values]
    means = sorted({cell[0] for cell in printed if cell is not None}, reverse=True)
    places = dict(zip(means, (BEST, SECOND), strict=False))
    marks = ["" if cell is None else places.get(cell[0], "") for cell in printed]
    if len(means) < 2:
        return marks, False
    spread = {
        rank: max(cell[1] for cell, r in zip(printed, marks, strict=True) if cell is not None and r == rank)
        for rank in (BEST, SECOND)
    }
    return marks, round(means[0] - means[1], 1) <= round(spread[BEST] + spread[SECOND], 1)


def _cell(value: tuple[float, float], rank: str, within_spread: bool) -> str:
    """A Markdown cell: mean±std, bold when best (with the dagger when within spread), underlined when second."""
    text = f"{value[0]:.1f}±{value[1]:.1f}"
    if rank == BEST:
        return f"**{text}**" + (WITHIN_SPREAD if within_spread else "")
    return f"<u>{text}</u>" if rank == SECOND else text


def _markdown(sites: list[str], columns: Columns, rows: Rows, notes: str, ranked_among: Rows | None = None) -> str:
    """One Markdown table of `rows` with its note, each column marked among `ranked_among` (default: `rows`)."""
    pool = ranked_among if ranked_among is not None else rows  # the rows each mark is earned among
    order = list(pool)
    ranked: dict[str, tuple[list[str], bool]] = {}
    for site, metric in columns:
        marks, within = ranks([cells[f"{site}:{metric}"] for cells in pool.values()])
        ranked[f"{site}:{metric}"] = ([marks[order.index(key)] for key in rows], within)
    header = [
        "Method",
        "H_g:H_l",
        *(f"{site} {label}" for site, metric in columns for m, label in TABLE_METRICS if m == metric),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, ((method, heads), cells) in enumerate(rows.items()):
        out = [method, heads]
        for site, metric in columns:
            value = cells[f"{site}:{metric}"]
            marks, within_spread = ranked[f"{site}:{metric}"]
            out.append("–" if value is None else _cell(value, marks[i], within_spread))
        lines.append("| " + " | ".join(out) + " |")
    note = (
        "\nPer-site: each site's personalised model on its own test split; Global: theta^g_T with phi_0 pooled "
        f"over all sites' test splits; {PHI_K_AVERAGED}: theta^g_T with the sites' phi_k averaged with theta^g_T's "
        "weights (simulation only; in the service phi_k never leaves a site), pooled the same way; "
        "% mean±std over seeds; per column, across every row of the report as Table I ranks them, bold = best and "
        "underlined = second-best by the mean "
        f"as printed (equal printed means share a mark); {WITHIN_SPREAD} = the best's lead over the second-best "
        "is within the seeds' spread (their mean±std ranges overlap), so no clear winner. "
        "Sites: " + ", ".join(sites) + ".\n" + _clinical_note(columns)
    )
    return "\n".join(lines) + "\n" + note + notes


def _clinical_note(columns: Columns) -> str:
    """What the clinical columns are, where the table has them."""
    if not {metric for _, metric in columns} & {metric for metric, _ in CLINICAL_COLUMNS}:
        return ""
    return (
        "AUROC: macro-AUROC; bal. acc.: balanced accuracy at 0.5; each the mean over the classes with both positives "
        "and negatives, exact per site, and for Global pooled from the sites' histograms (AUROC within its bound, "
        "docs/researcher/metrics.md).\n"
    )


def markdown_tables(sites: list[str], columns: Columns, rows: Rows, notes: str) -> str:
    """One table, or two labelled ones: rows on plain ResNet1D-34 (split "-") and rows on the hybrid model."""
    plain = {key: cells for key, cells in rows.items() if key[1] == NO_HEADS}
    hybrid = {key: cells for key, cells in rows.items() if key[1] != NO_HEADS}
    if not plain or not hybrid:
        return _markdown(sites, columns, rows, notes)
    return (
        "## FedCVD's ResNet1D-34 (Table I's baseline rows)\n\n"
        + _markdown(sites, columns, plain, "", rows)
        + "\n## The dual-attention hybrid model\n\n"
        + _markdown(sites, columns, hybrid, notes, rows)
    )


def _csv_name(column: str) -> str:
    """A column's name without spaces or brackets: "Global (phi_k averaged)" -> "Global_phi_k_averaged"."""
    return "_".join(re.findall(r"[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*", column))


def csv_text(columns: Columns, rows: Rows) -> str:
    """Table I as CSV: a row per (method, heads) with its seeds and each column's mean and std (4 decimals)."""
    handle = io.StringIO(newline="")
    writer = csv.writer(handle)
    names = [f"{_csv_name(s)}_{m}_{stat}" for s, m in columns for stat in ("mean", "std")]
    writer.writerow(["method", "heads", "seeds", *names])
    for (method, heads), cells in rows.items():
        values = []
        for site, metric in columns:
            value = cells[f"{site}:{metric}"]
            values += [f"{value[0]:.4f}", f"{value[1]:.4f}"] if value else ["", ""]
        writer.writerow([method, heads, cells["seeds"], *values])
    return handle.getvalue()


def _hard(gates: list[list[float]]) -> bool:
    """Whether every gate is exactly 0 or 1 (frozen)."""
    return all(g in (0.0, 1.0) for block in gates for g in block)


def effective_heads_table(runs: list[FinalMetrics], sites: list[str]) -> str:
    """Markdown: each learned site's effective number of local heads per block, with how hard its gates ended."""
    effective = effective_heads(runs)
    if not effective:
        return ""
    blocks = max(len(values) for values in effective.values())
    heads = max(len(block) for run in runs for curve in run.gate_curves.values() for _, g in curve[-1:] for block in g)
    header = [
        "Method",
        "Site",
        *(f"block {b}" for b in range(blocks)),
        "hard gates at the end",
        "farthest soft gate from ½",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = {site: i for i, site in enumerate(sites)}
    for method, site in sorted(effective, key=lambda k: (k[0], order.get(k[1], len(order)), k[1])):
        finals = [run.gate_curves[site][-1] for run in runs if run.method == method and run.gate_curves.get(site)]
        hard = sum(_hard(gates) for _, gates in finals)
        soft = [
            abs(g - 0.5)
            for run in runs
            if run.method == method
            for _, gates in run.gate_curves.get(site, [])
            if not _hard(gates)
            for block in gates
            for g in block
        ]
        cells = ["–" if v is None else f"{v[0]:.2f}±{v[1]:.2f}" for v in effective[(method, site)]]
        largest = f"{max(soft):.3f}" if soft else "–"
        lines.append("| " + " | ".join([method, site, *cells, f"{hard} of {len(finals)} seeds", largest]) + " |")
    rounds = sorted({t for run in runs for curve in run.gate_curves.values() for t, _ in curve[-1:]})
    return (
        "\n## Learned head assignment: effective number of local heads\n\n"
        + "\n".join(lines)
        + f"\n\nSum over a block's {heads} heads of the gates g (1 = the head is local, 0 = global) after the site's "
        f"last training round ({', '.join(str(t) for t in rounds)}), mean±std over seeds; a fixed split H_g:H_l has "
        "H_l. Hard gates: every gate of the site exactly 0 or 1 (frozen). Farthest soft gate from ½: the largest "
        "|g − ½| any of the site's gates reached in a round before they were hard, over every seed (freezing keeps "
        "the side of ½ each gate is on). gates.png shows the gates per round.\n"
    )


def external_table(runs: list[FinalMetrics]) -> str:
    """Markdown: each validation site's evaluation of theta^g_T on all its records, per (method, heads); "" without."""
    sites, columns, rows = external_rows(runs)
    if not rows:
        return ""
    header = [
        "Method",
        "H_g:H_l",
        *(f"{s} {label}" for s, metric in columns for m, label in TABLE_METRICS if m == metric),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ranked = {f"{s}:{m}": ranks([cells[f"{s}:{m}"] for cells in rows.values()]) for s, m in columns}
    for i, ((method, heads), cells) in enumerate(rows.items()):
        out = [method, heads]
        for site, metric in columns:
            value, (marks, within) = cells[f"{site}:{metric}"], ranked[f"{site}:{metric}"]
            out.append("–" if value is None else _cell(value, marks[i], within))
        lines.append("| " + " | ".join(out) + " |")
    return (
        "\n## External validation\n\n"
        + "\n".join(lines)
        + "\n\nEach validation site ("
        + ", ".join(sites)
        + ") never trained nor entered any aggregation: theta^g_T with phi_0 on all its records (train and test "
        "splits), % mean±std over seeds, marked as in Table I. The results hold every round it evaluated "
        "(`external`: every validation_every-th theta^g_t and the final one).\n"
    )
