"""Reports of an experiment's results: Table I (Markdown and CSV), the Fig. 2 head-ratio deltas, learning curves.

Per-site numbers are each site's personalised model (theta^g_T with its phi_k) on its own test
split, and Global is the global evaluation model theta^g_T with phi_0 pooled over every site's test
split, both from the final evaluation round; mean ± std over seeds (sample std, n-1), in percent.
Global pools only the sites with at least the study's privacy.min_records test records; the table's
note says when an experiment lowered that minimum, and when Global lacks a site below it.

Where an algorithm keeps BatchNorm at the site (FedBN, FedAH, FedALA with local statistics), Global
is theta^g_T with each site's own BatchNorm (label "Global (site BatchNorm)"), and the note names
those methods. Next to Global the table shows its second reading, "Global (phi_k averaged)":
theta^g_T with the sites' phi_k averaged, which only a simulation can evaluate.

Site columns follow the experiment config's order of sites (given to write_report, else as the
results recorded it; results without it: by name). In each column of each table the best
mean is bold and the second-best underlined, ranked by the mean as printed (0.1 %), so equal printed
means share a mark and the next lower mean is second-best. A dagger follows the best when its lead
over the second-best is within the seeds' spread (their mean ± std ranges overlap): no clear winner.

Below the table, the paper's direction (Fig. 2) is checked against 8:0 for each method that has it:
whether local heads raise each site's micro-F1, and whether 0:8 lowers Global's. A difference is
"within spread" when |mean_a - mean_b| <= std_a + std_b (as printed): the seeds cannot tell it apart.

Runs of learned head assignment (algorithm learned_heads, head split "learned") are a row of their
own. For them the report adds each site's gates per round (gates.png, the mean over seeds), each
site's effective number of local heads (the sum of its gates per block at its last training round,
mean ± std over seeds), and the claim checked with the same spread: is the learned assignment's
per-site micro-F1 within the spread of the best fixed split at that site, and its Global's of 8:0's?
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardiofl.experiment.config import LEARNED
from cardiofl.experiment.readings import PHI_K_AVERAGED
from shared.algorithms.exchange import GLOBAL
from shared.metrics import TOO_FEW_RECORDS
from shared.model import NO_HEADS, head_ratios, parse_heads
from shared.terms import PrivacyConfig

__all__ = ["FinalMetrics", "compare", "direction", "effective_heads", "learned_claim", "read_results", "write_report"]

METRICS = (("micro_f1", "F1"), ("map", "mAP"))
GLOBAL_READINGS = (GLOBAL, PHI_K_AVERAGED)  # the table's Global columns, the service's reading first
DEFAULT_MIN_RECORDS: int = PrivacyConfig.model_fields["min_records"].default


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
    min_records: int  # the study's privacy.min_records: fewer test records stay out of Global
    too_few: tuple[str, ...]  # sites whose test split was below it in the final evaluation
    global_label: str = GLOBAL  # what Global is: theta^g_T with phi_0, or also with each site's BatchNorm
    global_readings: dict[str, dict[str, float | None]] = field(default_factory=dict)  # label -> pooled summary
    site_order: tuple[str, ...] = ()  # the study's sites in the experiment config's order, when recorded
    # learned_heads: site -> (t, g_{k,b,h} after round t), one list of H gates per block
    gate_curves: dict[str, list[tuple[int, list[list[float]]]]] = field(default_factory=dict)

    def summary(self, column: str) -> dict[str, float | None] | None:
        """The summary of a table column: a site (personalised), Global, or another reading of Global."""
        if column == GLOBAL:
            return self.global_
        if column in GLOBAL_READINGS:
            return self.global_readings.get(column)
        return self.sites.get(column)


def _too_few(record: dict[str, Any]) -> tuple[str, ...]:
    """The sites of a round record that reported too few test records for the pooled statistics."""
    reports = record["sites"].items()
    return tuple(sorted(site for site, values in reports if (values["previous_global"] or {}).get(TOO_FEW_RECORDS)))


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
        gate_curves: dict[str, list[tuple[int, list[list[float]]]]] = defaultdict(list)
        for r in records:
            if r["kind"] == "train":
                for site, values in r["sites"].items():
                    if values["local"]:
                        site_curves[site].append((r["round"], values["local"]))
                    if values.get("gates") is not None:
                        gate_curves[site].append((r["round"], values["gates"]))
        runs.append(
            FinalMetrics(
                method=final["method"],
                heads=final["heads"],
                seed=final["seed"],
                sites={site: values["local"] for site, values in final["sites"].items()},
                global_=final["previous_global"],
                curve=curve,
                site_curves=dict(site_curves),
                min_records=final.get("min_records", DEFAULT_MIN_RECORDS),
                too_few=_too_few(final),
                global_label=final.get("global_label", GLOBAL),
                global_readings=final.get("global_readings") or {},
                site_order=tuple(final.get("site_order") or ()),
                gate_curves=dict(gate_curves),
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


def _site_order(runs: list[FinalMetrics], sites: Sequence[str] | None) -> list[str]:
    """The sites with results, in the given (config) order, else as recorded, then any others by name."""
    present = {site for run in runs for site in run.sites}
    listed = list(sites) if sites is not None else next((list(run.site_order) for run in runs if run.site_order), [])
    ordered = [site for site in dict.fromkeys(listed) if site in present]
    return ordered + sorted(present - set(ordered))


def _table(
    runs: list[FinalMetrics], site_order: Sequence[str] | None = None
) -> tuple[list[str], list[tuple[str, str]], dict[tuple[str, str], dict[str, Any]]]:
    sites = _site_order(runs, site_order)
    columns = [(site, metric) for site in [*sites, *GLOBAL_READINGS] for metric, _ in METRICS]
    order = {ratio: i for i, ratio in enumerate(head_ratios(8))}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    grouped: dict[tuple[str, str], list[FinalMetrics]] = defaultdict(list)
    for run in runs:
        grouped[(run.method, run.heads)].append(run)
    for key in sorted(grouped, key=lambda k: (k[0], order.get(k[1], 99), k[1])):
        group = grouped[key]
        cells = {}
        for site, metric in columns:
            values = [_value(r.summary(site), metric) for r in group]
            cells[f"{site}:{metric}"] = _mean_std(values)
        cells["seeds"] = len(group)
        rows[key] = cells
    return sites, columns, rows


def _privacy_note(runs: list[FinalMetrics]) -> str:
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


def _global_note(runs: list[FinalMetrics]) -> str:
    """Which methods' Global model takes each site's own BatchNorm."""
    site_batchnorm = sorted({run.method for run in runs if run.global_label != GLOBAL})
    if not site_batchnorm:
        return ""
    labels = sorted({run.global_label for run in runs if run.global_label != GLOBAL})
    return (
        f"{', '.join(labels)}: for {', '.join(site_batchnorm)}, whose BatchNorm stays at the sites, each site "
        "evaluated theta^g_T with its own trained BatchNorm (phi_0's are untrained).\n"
    )


BEST, SECOND = "best", "second"
WITHIN_SPREAD = "†"  # after a best whose lead over the second-best is within the seeds' spread


def _shown(value: tuple[float, float]) -> tuple[float, float]:
    """A cell's mean and std as the table prints them."""
    return float(f"{value[0]:.1f}"), float(f"{value[1]:.1f}")


def _ranks(values: list[tuple[float, float] | None]) -> tuple[list[str], bool]:
    """One column's marks (BEST, SECOND or "") and whether the best's lead is within the seeds' spread."""
    shown = [None if value is None else _shown(value) for value in values]
    means = sorted({cell[0] for cell in shown if cell is not None}, reverse=True)
    places = dict(zip(means, (BEST, SECOND), strict=False))
    ranks = ["" if cell is None else places.get(cell[0], "") for cell in shown]
    if len(means) < 2:
        return ranks, False
    spread = {
        rank: max(cell[1] for cell, r in zip(shown, ranks, strict=True) if cell is not None and r == rank)
        for rank in (BEST, SECOND)
    }
    return ranks, round(means[0] - means[1], 1) <= round(spread[BEST] + spread[SECOND], 1)


def _cell(value: tuple[float, float], rank: str, within_spread: bool) -> str:
    """A Markdown cell: mean±std, bold when best (with the dagger when within spread), underlined when second."""
    text = f"{value[0]:.1f}±{value[1]:.1f}"
    if rank == BEST:
        return f"**{text}**" + (WITHIN_SPREAD if within_spread else "")
    return f"<u>{text}</u>" if rank == SECOND else text


def _markdown(
    sites: list[str],
    columns: list[tuple[str, str]],
    rows: dict[tuple[str, str], dict[str, Any]],
    privacy_note: str,
    ranked_among: dict[tuple[str, str], dict[str, Any]] | None = None,
) -> str:
    pool = ranked_among if ranked_among is not None else rows  # the rows each mark is earned among
    order = list(pool)
    ranked: dict[str, tuple[list[str], bool]] = {}
    for site, metric in columns:
        ranks, within = _ranks([cells[f"{site}:{metric}"] for cells in pool.values()])
        ranked[f"{site}:{metric}"] = ([ranks[order.index(key)] for key in rows], within)
    header = [
        "Method",
        "H_g:H_l",
        *(f"{site} {label}" for site, metric in columns for m, label in METRICS if m == metric),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, ((method, heads), cells) in enumerate(rows.items()):
        out = [method, heads]
        for site, metric in columns:
            value = cells[f"{site}:{metric}"]
            ranks, within_spread = ranked[f"{site}:{metric}"]
            out.append("–" if value is None else _cell(value, ranks[i], within_spread))
        lines.append("| " + " | ".join(out) + " |")
    note = (
        "\nPer-site: each site's personalised model on its own test split; Global: theta^g_T with phi_0 pooled "
        f"over all sites' test splits; {PHI_K_AVERAGED}: theta^g_T with the sites' phi_k averaged with theta^g_T's "
        "weights (simulation only; in the service phi_k never leaves a site), pooled the same way; "
        "% mean±std over seeds; per column, across every row of the report as Table I ranks them, bold = best and "
        "underlined = second-best by the mean "
        f"as printed (equal printed means share a mark); {WITHIN_SPREAD} = the best's lead over the second-best "
        "is within the seeds' spread (their mean±std ranges overlap), so no clear winner. "
        "Sites: " + ", ".join(sites) + ".\n"
    )
    return "\n".join(lines) + "\n" + note + privacy_note


def _tables(
    sites: list[str], columns: list[tuple[str, str]], rows: dict[tuple[str, str], dict[str, Any]], notes: str
) -> str:
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


BASELINE, ALL_LOCAL = "8:0", "0:8"  # Fig. 2's reference split and the split the paper says lowers Global
RAISED, LOWERED, WITHIN = "raised", "lowered", "within spread"
HIGHER = "higher"  # a count of splits whose mean is above 8:0's, beyond the spread or not
ONE_SEED = "one seed"  # a difference with no spread to judge it by: neither a finding nor within spread


def compare(value: tuple[float, float], baseline: tuple[float, float]) -> tuple[float, str]:
    """(mean - baseline mean, RAISED/LOWERED, or WITHIN when |difference| <= the sum of their stds), as printed."""
    (mean, std), (base, base_std) = _shown(value), _shown(baseline)
    delta = round(mean - base, 1)
    if abs(delta) <= round(std + base_std, 1):
        return delta, WITHIN
    return delta, RAISED if delta > 0 else LOWERED


def _signed(delta: float) -> str:
    """A difference with its sign and a true minus: "+3.1", "−2.0"."""
    return f"{delta:+.1f}".replace("-", "−")


def _split_deltas(
    rows: dict[tuple[str, str], dict[str, Any]], method: str, splits: list[str], column: str
) -> tuple[list[str], dict[str, int]]:
    """Each split's difference to 8:0 in `column` ("6:2 +3.1 raised"), and how many fall in each mark."""
    baseline = rows[(method, BASELINE)][column]
    parts: list[str] = []
    counts = {RAISED: 0, LOWERED: 0, WITHIN: 0, HIGHER: 0, ONE_SEED: 0}
    for heads in splits:
        value = rows[(method, heads)][column]
        if value is None:
            continue
        delta, mark = compare(value, baseline)
        if min(rows[(method, heads)]["seeds"], rows[(method, BASELINE)]["seeds"]) < 2:
            mark = ONE_SEED
        counts[mark] += 1
        counts[HIGHER] += delta > 0
        parts.append(f"{heads} {_signed(delta)} {mark}")
    return parts, counts


def _site_verdict(counts: dict[str, int]) -> str:
    """A site's finding over the splits with local heads, from how many raise or lower its F1 beyond the spread."""
    raised, lowered, total = counts[RAISED], counts[LOWERED], counts[RAISED] + counts[LOWERED] + counts[WITHIN]
    if raised and lowered:
        return "mixed"
    if raised:
        return "holds" if raised * 2 > total else f"partly (raised beyond the spread in {raised} of {total} splits)"
    if lowered:
        return "reversed" if lowered * 2 > total else f"partly reversed (lowered in {lowered} of {total} splits)"
    if not total:
        return "not judged (one seed)"
    return f"not shown (within the seeds' spread; {counts[HIGHER]} of {total} splits higher)"


def direction(runs: list[FinalMetrics], site_order: Sequence[str] | None = None) -> str:
    """The paper's direction against 8:0, per method: local heads raise per-site F1, 0:8 lowers Global."""
    sites, _, rows = _table(runs, site_order)
    ratio_order = {ratio: i for i, ratio in enumerate(head_ratios(8))}
    lines: list[str] = []
    for method in dict.fromkeys(method for method, _ in rows):
        splits = sorted(
            (h for m, h in rows if m == method and h not in (NO_HEADS, BASELINE, LEARNED) and parse_heads(h)[1] > 0),
            key=lambda h: (ratio_order.get(h, 99), h),
        )
        if (method, BASELINE) not in rows or not splits:
            continue
        seeds = min(rows[(method, h)]["seeds"] for h in [BASELINE, *splits])
        lines.append(
            f"### {method}: each split with local heads against {BASELINE} (micro-F1 %, mean±std over {seeds} seeds)\n"
        )
        if seeds < 2:
            lines.append("One seed only: no spread to judge the differences by.\n")
        verdicts: list[str] = []
        for site in sites:
            column = f"{site}:micro_f1"
            baseline = rows[(method, BASELINE)][column]
            if baseline is None:
                continue
            parts, counts = _split_deltas(rows, method, splits, column)
            flat = all(rows[(method, h)][column] in (None, (0.0, 0.0)) for h in [BASELINE, *splits])
            verdict = "not measurable (F1 0.0 at every split)" if flat else _site_verdict(counts)
            verdicts.append(verdict)
            lines.append(
                f"- Local heads raise {site}'s F1: {verdict}. {BASELINE} {baseline[0]:.1f}±{baseline[1]:.1f}; "
                + ", ".join(parts)
                + f" ({counts[RAISED]} raised, {counts[WITHIN]} within spread, {counts[LOWERED]} lowered"
                + (f", {counts[ONE_SEED]} one seed only" if counts[ONE_SEED] else "")
                + ")."
            )
        for label in GLOBAL_READINGS:
            column = f"{label}:micro_f1"
            baseline, all_local = rows[(method, BASELINE)][column], rows.get((method, ALL_LOCAL), {}).get(column)
            if baseline is None or all_local is None:
                continue
            delta, mark = compare(all_local, baseline)
            if min(rows[(method, ALL_LOCAL)]["seeds"], rows[(method, BASELINE)]["seeds"]) < 2:
                mark = ONE_SEED
            side = "lower" if delta < 0 else "higher" if delta > 0 else "equal"
            within = f"not shown (within the seeds' spread; {side} at {ALL_LOCAL})"
            verdict = {LOWERED: "holds", RAISED: "reversed", WITHIN: within, ONE_SEED: "not judged (one seed)"}[mark]
            parts, _ = _split_deltas(rows, method, splits, column)
            lines.append(
                f"- {ALL_LOCAL} lowers {label} F1: {verdict}. {BASELINE} {baseline[0]:.1f}±{baseline[1]:.1f}, "
                f"{ALL_LOCAL} {all_local[0]:.1f}±{all_local[1]:.1f} ({_signed(delta)} pp, {mark}); every split: "
                + ", ".join(parts)
                + "."
            )
        held, partly = verdicts.count("holds"), sum(v.startswith("partly (") for v in verdicts)
        lines.append(
            f"\nPer-site: the paper's direction holds at {held} of {len(verdicts)} sites, partly at {partly}.\n"
        )
    if not lines:
        return ""
    head = (
        "\n## The paper's direction (Fig. 2)\n\n"
        "Paper: local heads raise per-site micro-F1 (+5 to +10 pp from 7:1 on), and Global falls as local heads "
        'grow (−21.9 pp at 0:8). Differences are to 8:0 in percentage points; "within spread" = |difference| '
        "<= the sum of the two stds (the seeds cannot tell them apart). A site's finding holds when most splits "
        "raise its F1 beyond the spread and none lowers it.\n\n"
    )
    return head + "\n".join(lines) + "\n"


def _fixed_splits(rows: dict[tuple[str, str], dict[str, Any]], method: str) -> list[str]:
    """The fixed head splits of `method` in the table, from 8:0 to 0:8."""
    order = {ratio: i for i, ratio in enumerate(head_ratios(8))}
    fixed = [h for m, h in rows if m == method and h not in (NO_HEADS, LEARNED)]
    return sorted(fixed, key=lambda h: (order.get(h, 99), h))


def _claim_verdict(mark: str, reference: str) -> str:
    """The claim's verdict for one comparison of the learned row with `reference`, from compare's mark."""
    return {
        WITHIN: f"holds (within the seeds' spread of {reference})",
        RAISED: f"holds (above {reference}, beyond the spread)",
        LOWERED: f"fails (below {reference}, beyond the spread)",
        ONE_SEED: "not judged (one seed)",
    }[mark]


def _judged(
    rows: dict[tuple[str, str], dict[str, Any]], learned: tuple[str, str], fixed: tuple[str, str], column: str
) -> tuple[float, str]:
    """compare() of the learned row with a fixed row in `column`, ONE_SEED when either has a single seed."""
    delta, mark = compare(rows[learned][column], rows[fixed][column])
    return delta, ONE_SEED if min(rows[learned]["seeds"], rows[fixed]["seeds"]) < 2 else mark


def learned_claim(runs: list[FinalMetrics], site_order: Sequence[str] | None = None) -> str:
    """The claim for each learned method: per site within the spread of the best fixed split, Global of 8:0."""
    sites, _, rows = _table(runs, site_order)
    learned_methods = [m for m, h in rows if h == LEARNED]
    fixed_methods = [m for m in dict.fromkeys(m for m, _ in rows) if (m, BASELINE) in rows]
    lines: list[str] = []
    for learned, fixed_method in ((lm, fm) for lm in learned_methods for fm in fixed_methods):
        key, splits = (learned, LEARNED), _fixed_splits(rows, fixed_method)
        seeds = min(rows[(m, h)]["seeds"] for m, h in [key, *((fixed_method, s) for s in splits)])
        lines.append(f"### {learned} against {fixed_method}'s fixed splits (micro-F1 %, mean±std over {seeds} seeds)\n")
        held = judged = 0
        for site in sites:
            column = f"{site}:micro_f1"
            values = [rows[(fixed_method, h)][column] for h in splits]
            ranks, _ = _ranks(values)
            best = [h for h, rank in zip(splits, ranks, strict=True) if rank == BEST]
            value = rows[key][column]
            if not best or value is None:
                continue
            top = best[0]  # equal printed means share the mark: the first of them in split order is the reference
            delta, mark = _judged(rows, key, (fixed_method, top), column)
            flat = value == (0.0, 0.0) and all(v in (None, (0.0, 0.0)) for v in values)
            verdict = (
                "not measurable (F1 0.0 everywhere)" if flat else _claim_verdict(mark, f"the best fixed split {top}")
            )
            judged += mark != ONE_SEED and not flat
            held += verdict.startswith("holds")
            ties = f" (tied with {', '.join(best[1:])})" if len(best) > 1 else ""
            best_value = rows[(fixed_method, top)][column]
            above = sum(v is not None and _shown(v)[0] < _shown(value)[0] for v in values)
            lines.append(
                f"- {site}: {verdict}. {LEARNED} {value[0]:.1f}±{value[1]:.1f}, best fixed {top}{ties} "
                f"{best_value[0]:.1f}±{best_value[1]:.1f} ({_signed(delta)} pp, {mark}); {LEARNED} is above "
                f"{above} of {len(splits)} fixed splits."
            )
        column, on_global = f"{GLOBAL}:micro_f1", "not measured"
        if rows[key][column] is not None and rows[(fixed_method, BASELINE)][column] is not None:
            delta, mark = _judged(rows, key, (fixed_method, BASELINE), column)
            value, base = rows[key][column], rows[(fixed_method, BASELINE)][column]
            on_global = _claim_verdict(mark, BASELINE)
            lines.append(
                f"- {GLOBAL}: {on_global}. {LEARNED} {value[0]:.1f}±{value[1]:.1f}, "
                f"{BASELINE} {base[0]:.1f}±{base[1]:.1f} ({_signed(delta)} pp, {mark})."
            )
        holds = judged > 0 and held == judged and on_global.startswith("holds")
        overall = "the claim holds" if holds else "not judged" if not judged else "the claim does not hold"
        lines.append(
            f"\nPer-site: the claim holds at {held} of {judged} sites judged; {GLOBAL}: "
            f"{on_global.split(' (')[0]}. Overall: {overall}.\n"
        )
    if not lines:
        return ""
    head = (
        "\n## Learned head assignment: the claim\n\n"
        "Claim: the learned assignment does as well as the best fixed split at every site, and keeps Global "
        f'where {BASELINE} has it. "Within the seeds\' spread" as above: |difference| <= the sum of the two stds. '
        "The best fixed split is each site's best mean, chosen after the fact from the same seeds, so the bar is "
        "higher than any one split chosen in advance.\n\n"
    )
    return head + "\n".join(lines) + "\n"


def effective_heads(runs: list[FinalMetrics]) -> dict[tuple[str, str], list[tuple[float, float] | None]]:
    """(method, site) -> per block: the sum of g over heads after the site's last training round, mean and std."""
    sums: dict[tuple[str, str], list[list[float]]] = defaultdict(list)
    for run in runs:
        for site, curve in run.gate_curves.items():
            if curve:
                sums[(run.method, site)].append([sum(block) for block in curve[-1][1]])
    return {
        key: [_mean_std([seed[b] for seed in per_seed]) for b in range(max(len(seed) for seed in per_seed))]
        for key, per_seed in sums.items()
    }


def _hard(gates: list[list[float]]) -> bool:
    """Whether every gate is exactly 0 or 1 (frozen)."""
    return all(g in (0.0, 1.0) for block in gates for g in block)


def _effective_heads_table(runs: list[FinalMetrics], sites: list[str]) -> str:
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


def _plot_gates(path: Path, runs: list[FinalMetrics], sites: list[str]) -> bool:
    """Each site's learned gates per round, mean over seeds: a panel per (method, block) and site, a line per head."""
    learned = [run for run in runs if run.gate_curves]
    if not learned:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(run.method for run in learned))
    panels = [site for site in sites if any(site in run.gate_curves for run in learned)]
    blocks = max(len(gates) for run in learned for curve in run.gate_curves.values() for _, gates in curve)
    rows = [(method, b) for method in methods for b in range(blocks)]
    fig, axes = plt.subplots(
        len(rows), len(panels), figsize=(3.6 * len(panels) + 1.4, 2.8 * len(rows)), squeeze=False, sharey=True
    )
    colours = plt.get_cmap("tab10")
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _csv_name(column: str) -> str:
    """A column's name without spaces or brackets: "Global (phi_k averaged)" -> "Global_phi_k_averaged"."""
    return "_".join(re.findall(r"[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*", column))


def _csv(path: Path, columns: list[tuple[str, str]], rows: dict[tuple[str, str], dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        names = [f"{_csv_name(s)}_{m}_{stat}" for s, m in columns for stat in ("mean", "std")]
        writer.writerow(["method", "heads", "seeds", *names])
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
                values = [_value(run.summary(who), metric) for run in chosen if run.heads == ratio]
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


def write_report(results: Path, out_dir: Path, *, sites: Sequence[str] | None = None) -> dict[str, Path]:
    """Write table.md, table.csv, curves.png, head_ratio_deltas.png and gates.png; `sites` orders the site columns."""
    runs = read_results(results)
    if not runs:
        raise ValueError(f"{results} holds no finished run")
    out_dir.mkdir(parents=True, exist_ok=True)
    site_names, columns, rows = _table(runs, sites)
    written = {
        "table.md": out_dir / "table.md",
        "table.csv": out_dir / "table.csv",
        "curves.png": out_dir / "curves.png",
    }
    notes = _global_note(runs) + _privacy_note(runs)
    learned = _effective_heads_table(runs, site_names) + learned_claim(runs, sites)
    written["table.md"].write_text(_tables(site_names, columns, rows, notes) + direction(runs, sites) + learned)
    _csv(written["table.csv"], columns, rows)
    _plot_curves(written["curves.png"], runs)
    if _plot_ratio_deltas(out_dir / "head_ratio_deltas.png", runs, site_names):
        written["head_ratio_deltas.png"] = out_dir / "head_ratio_deltas.png"
    if _plot_gates(out_dir / "gates.png", runs, site_names):
        written["gates.png"] = out_dir / "gates.png"
    return written
