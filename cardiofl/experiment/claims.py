"""The report's claims tested against the seeds' spread: the paper's direction (Fig. 2) and learned heads' claim.

The paper's direction is checked against 8:0 for each method that has it: whether local heads raise
each site's micro-F1, and whether 0:8 lowers Global's. A difference is "within spread" when
|mean_a - mean_b| <= std_a + std_b (as printed): the seeds cannot tell it apart.

Runs of learned head assignment (algorithm learned_heads, head split "learned") are a row of their
own, and their claim is checked with the same spread: is the learned assignment's per-site micro-F1
within the spread of the best fixed split at that site, and its Global's of 8:0's?
"""

from __future__ import annotations

from collections.abc import Sequence

from cardiofl.experiment.config import LEARNED
from cardiofl.experiment.results import BASELINE, GLOBAL_READINGS, FinalMetrics, Rows, split_key, table_rows
from cardiofl.experiment.tables import BEST, ranks, shown
from shared.algorithms.exchange import GLOBAL
from shared.model.network import NO_HEADS, parse_heads

__all__ = [
    "ALL_LOCAL",
    "HIGHER",
    "LOWERED",
    "ONE_SEED",
    "PLANTED_TOLERANCE",
    "RAISED",
    "WITHIN",
    "compare",
    "direction",
    "learned_claim",
]

ALL_LOCAL = "0:8"  # the split the paper says lowers Global
RAISED, LOWERED, WITHIN = "raised", "lowered", "within spread"
HIGHER = "higher"  # a count of splits whose mean is above 8:0's, beyond the spread or not
ONE_SEED = "one seed"  # a difference with no spread to judge it by: neither a finding nor within spread
PLANTED_TOLERANCE = 1  # heads: how far a site's effective local heads may be from its planted H_l

DIRECTION_HEAD = (
    "\n## The paper's direction (Fig. 2)\n\n"
    "Paper: local heads raise per-site micro-F1 (+5 to +10 pp from 7:1 on), and Global falls as local heads "
    'grow (−21.9 pp at 0:8). Differences are to 8:0 in percentage points; "within spread" = |difference| '
    "<= the sum of the two stds (the seeds cannot tell them apart). A site's finding holds when most splits "
    "raise its F1 beyond the spread and none lowers it.\n\n"
)
CLAIM_HEAD = (
    "\n## Learned head assignment: the claim\n\n"
    "Claim: the learned assignment does as well as the best fixed split at every site, and keeps Global "
    f'where {BASELINE} has it. "Within the seeds\' spread" as above: |difference| <= the sum of the two stds. '
    "The best fixed split is each site's best mean, chosen after the fact from the same seeds, so the bar is "
    "higher than any one split chosen in advance.\n\n"
)


def compare(value: tuple[float, float], baseline: tuple[float, float]) -> tuple[float, str]:
    """(mean - baseline mean, RAISED/LOWERED, or WITHIN when |difference| <= the sum of their stds), as printed."""
    (mean, std), (base, base_std) = shown(value), shown(baseline)
    delta = round(mean - base, 1)
    if abs(delta) <= round(std + base_std, 1):
        return delta, WITHIN
    return delta, RAISED if delta > 0 else LOWERED


def _signed(delta: float) -> str:
    """A difference with its sign and a true minus: "+3.1", "−2.0"."""
    return f"{delta:+.1f}".replace("-", "−")


def _judged(rows: Rows, row: tuple[str, str], reference: tuple[str, str], column: str) -> tuple[float, str]:
    """compare() of `row` with `reference` in `column`, ONE_SEED when either has a single seed."""
    delta, mark = compare(rows[row][column], rows[reference][column])
    return delta, ONE_SEED if min(rows[row]["seeds"], rows[reference]["seeds"]) < 2 else mark


def _fixed_splits(rows: Rows, method: str) -> list[str]:
    """The fixed head splits of `method` in the table, from 8:0 to 0:8."""
    return sorted((h for m, h in rows if m == method and h not in (NO_HEADS, LEARNED)), key=split_key)


def _split_deltas(rows: Rows, method: str, splits: list[str], column: str) -> tuple[list[str], dict[str, int]]:
    """Each split's difference to 8:0 in `column` ("6:2 +3.1 raised"), and how many fall in each mark."""
    parts: list[str] = []
    counts = {RAISED: 0, LOWERED: 0, WITHIN: 0, HIGHER: 0, ONE_SEED: 0}
    for heads in splits:
        if rows[(method, heads)][column] is None:
            continue
        delta, mark = _judged(rows, (method, heads), (method, BASELINE), column)
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


def _site_direction(rows: Rows, method: str, splits: list[str], site: str) -> tuple[str, str] | None:
    """The line and verdict of "local heads raise the site's F1", None without an 8:0 value there."""
    column = f"{site}:micro_f1"
    baseline = rows[(method, BASELINE)][column]
    if baseline is None:
        return None
    parts, counts = _split_deltas(rows, method, splits, column)
    flat = all(rows[(method, h)][column] in (None, (0.0, 0.0)) for h in [BASELINE, *splits])
    verdict = "not measurable (F1 0.0 at every split)" if flat else _site_verdict(counts)
    line = (
        f"- Local heads raise {site}'s F1: {verdict}. {BASELINE} {baseline[0]:.1f}±{baseline[1]:.1f}; "
        + ", ".join(parts)
        + f" ({counts[RAISED]} raised, {counts[WITHIN]} within spread, {counts[LOWERED]} lowered"
        + (f", {counts[ONE_SEED]} one seed only" if counts[ONE_SEED] else "")
        + ")."
    )
    return line, verdict


def _global_direction(rows: Rows, method: str, splits: list[str], label: str) -> str | None:
    """The line of "0:8 lowers this reading of Global's F1", None without both 8:0's and 0:8's value."""
    column = f"{label}:micro_f1"
    baseline, all_local = rows[(method, BASELINE)][column], rows.get((method, ALL_LOCAL), {}).get(column)
    if baseline is None or all_local is None:
        return None
    delta, mark = _judged(rows, (method, ALL_LOCAL), (method, BASELINE), column)
    side = "lower" if delta < 0 else "higher" if delta > 0 else "equal"
    within = f"not shown (within the seeds' spread; {side} at {ALL_LOCAL})"
    verdict = {LOWERED: "holds", RAISED: "reversed", WITHIN: within, ONE_SEED: "not judged (one seed)"}[mark]
    parts, _ = _split_deltas(rows, method, splits, column)
    return (
        f"- {ALL_LOCAL} lowers {label} F1: {verdict}. {BASELINE} {baseline[0]:.1f}±{baseline[1]:.1f}, "
        f"{ALL_LOCAL} {all_local[0]:.1f}±{all_local[1]:.1f} ({_signed(delta)} pp, {mark}); every split: "
        + ", ".join(parts)
        + "."
    )


def _method_direction(rows: Rows, sites: list[str], method: str) -> list[str]:
    """The direction's lines for one method: none without 8:0 or a split with local heads."""
    splits = [h for h in _fixed_splits(rows, method) if h != BASELINE and parse_heads(h)[1] > 0]
    if (method, BASELINE) not in rows or not splits:
        return []
    seeds = min(rows[(method, h)]["seeds"] for h in [BASELINE, *splits])
    lines = [
        f"### {method}: each split with local heads against {BASELINE} (micro-F1 %, mean±std over {seeds} seeds)\n"
    ]
    if seeds < 2:
        lines.append("One seed only: no spread to judge the differences by.\n")
    on_sites = [found for site in sites if (found := _site_direction(rows, method, splits, site)) is not None]
    lines += [line for line, _ in on_sites]
    lines += [line for label in GLOBAL_READINGS if (line := _global_direction(rows, method, splits, label)) is not None]
    verdicts = [verdict for _, verdict in on_sites]
    held, partly = verdicts.count("holds"), sum(v.startswith("partly (") for v in verdicts)
    lines.append(f"\nPer-site: the paper's direction holds at {held} of {len(verdicts)} sites, partly at {partly}.\n")
    return lines


def direction(runs: list[FinalMetrics], site_order: Sequence[str] | None = None) -> str:
    """The paper's direction against 8:0, per method: local heads raise per-site F1, 0:8 lowers Global."""
    sites, _, rows = table_rows(runs, site_order)
    lines = [line for method in dict.fromkeys(m for m, _ in rows) for line in _method_direction(rows, sites, method)]
    return DIRECTION_HEAD + "\n".join(lines) + "\n" if lines else ""


def _claim_verdict(mark: str, reference: str) -> str:
    """The claim's verdict for one comparison of the learned row with `reference`, from compare's mark."""
    return {
        WITHIN: f"holds (within the seeds' spread of {reference})",
        RAISED: f"holds (above {reference}, beyond the spread)",
        LOWERED: f"fails (below {reference}, beyond the spread)",
        ONE_SEED: "not judged (one seed)",
    }[mark]


def _site_claim(rows: Rows, learned: str, fixed_method: str, splits: list[str], site: str) -> tuple[str, str] | None:
    """The claim's line and verdict at a site, None without a best fixed split or a learned value there."""
    key, column = (learned, LEARNED), f"{site}:micro_f1"
    values = [rows[(fixed_method, h)][column] for h in splits]
    marks, _ = ranks(values)
    best = [h for h, rank in zip(splits, marks, strict=True) if rank == BEST]
    value = rows[key][column]
    if not best or value is None:
        return None
    top = best[0]  # equal printed means share the mark: the first of them in split order is the reference
    delta, mark = _judged(rows, key, (fixed_method, top), column)
    flat = value == (0.0, 0.0) and all(v in (None, (0.0, 0.0)) for v in values)
    verdict = "not measurable (F1 0.0 everywhere)" if flat else _claim_verdict(mark, f"the best fixed split {top}")
    ties = f" (tied with {', '.join(best[1:])})" if len(best) > 1 else ""
    best_value = rows[(fixed_method, top)][column]
    above = sum(v is not None and shown(v)[0] < shown(value)[0] for v in values)
    line = (
        f"- {site}: {verdict}. {LEARNED} {value[0]:.1f}±{value[1]:.1f}, best fixed {top}{ties} "
        f"{best_value[0]:.1f}±{best_value[1]:.1f} ({_signed(delta)} pp, {mark}); {LEARNED} is above "
        f"{above} of {len(splits)} fixed splits."
    )
    return line, verdict


def _global_claim(rows: Rows, learned: str, fixed_method: str) -> tuple[str | None, str]:
    """The claim's line on Global (None when either row lacks it) and its verdict ("not measured" then)."""
    key, base_key, column = (learned, LEARNED), (fixed_method, BASELINE), f"{GLOBAL}:micro_f1"
    value, base = rows[key][column], rows[base_key][column]
    if value is None or base is None:
        return None, "not measured"
    delta, mark = _judged(rows, key, base_key, column)
    verdict = _claim_verdict(mark, BASELINE)
    line = (
        f"- {GLOBAL}: {verdict}. {LEARNED} {value[0]:.1f}±{value[1]:.1f}, "
        f"{BASELINE} {base[0]:.1f}±{base[1]:.1f} ({_signed(delta)} pp, {mark})."
    )
    return line, verdict


def _method_claim(rows: Rows, sites: list[str], learned: str, fixed_method: str) -> list[str]:
    """The claim's lines for one learned method against one method's fixed splits."""
    splits = _fixed_splits(rows, fixed_method)
    seeds = min(rows[(m, h)]["seeds"] for m, h in [(learned, LEARNED), *((fixed_method, s) for s in splits)])
    lines = [f"### {learned} against {fixed_method}'s fixed splits (micro-F1 %, mean±std over {seeds} seeds)\n"]
    on_sites = [
        found for site in sites if (found := _site_claim(rows, learned, fixed_method, splits, site)) is not None
    ]
    lines += [line for line, _ in on_sites]
    judged = sum(verdict.startswith(("holds", "fails")) for _, verdict in on_sites)  # not one seed, not all 0.0
    held = sum(verdict.startswith("holds") for _, verdict in on_sites)
    global_line, on_global = _global_claim(rows, learned, fixed_method)
    lines += [global_line] if global_line is not None else []
    holds = judged > 0 and held == judged and on_global.startswith("holds")
    overall = "the claim holds" if holds else "not judged" if not judged else "the claim does not hold"
    lines.append(
        f"\nPer-site: the claim holds at {held} of {judged} sites judged; {GLOBAL}: "
        f"{on_global.split(' (')[0]}. Overall: {overall}.\n"
    )
    return lines


def _planted_heads(runs: list[FinalMetrics], sites: list[str], learned: str) -> list[str]:
    """Planted sites: whether each site's effective local heads are within 1 of its planted H_l, per seed and block."""
    mine = [run for run in runs if run.method == learned and run.heads == LEARNED and run.planted]
    if not mine:
        return []
    lines = [f"### {learned}: effective local heads against the planted H_l (within {PLANTED_TOLERANCE} head)\n"]
    recovered = 0
    for site in sites:
        sums = [[sum(block) for block in run.gate_curves[site][-1][1]] for run in mine if run.gate_curves.get(site)]
        if not sums or site not in mine[0].planted:
            continue
        planted = mine[0].planted[site]
        close = sum(abs(value - planted) <= PLANTED_TOLERANCE for seed in sums for value in seed)
        pairs = sum(len(seed) for seed in sums)
        blocks = ", ".join(f"{sum(s[b] for s in sums) / len(sums):.2f}" for b in range(len(sums[0])))
        verdict = "holds" if close == pairs else "fails"
        recovered += close == pairs
        lines.append(
            f"- {site}: {verdict}. planted H_l {planted}; mean effective local heads per block {blocks}; "
            f"within {PLANTED_TOLERANCE} head in {close} of {pairs} (seed, block) pairs."
        )
    judged = len(lines) - 1
    lines.append(f"\nPlanted H_l recovered at {recovered} of {judged} sites.\n")
    return lines


def learned_claim(runs: list[FinalMetrics], site_order: Sequence[str] | None = None) -> str:
    """The claim for each learned method: per site within the spread of the best fixed split, Global of 8:0.

    On planted sites it also says whether each site's effective local heads are within 1 of its planted H_l.
    """
    sites, _, rows = table_rows(runs, site_order)
    learned_methods = [m for m, h in rows if h == LEARNED]
    fixed_methods = [m for m in dict.fromkeys(m for m, _ in rows) if (m, BASELINE) in rows]
    lines = [line for lm in learned_methods for fm in fixed_methods for line in _method_claim(rows, sites, lm, fm)]
    lines += [line for lm in learned_methods for line in _planted_heads(runs, sites, lm)]
    return CLAIM_HEAD + "\n".join(lines) + "\n" if lines else ""
