"""An experiment's results: the finished runs of the runner's JSON-lines file, aggregated over seeds per table row.

Per-site numbers are each site's personalised model (theta^g_T with its phi_k) on its own test
split, and Global is the global evaluation model theta^g_T with phi_0 pooled over every site's test
split, both from the final evaluation round; mean ± std over seeds (sample std, n-1), in percent.
Global pools only the sites with at least the study's privacy.min_records test records. Each column
holds FedCVD's micro-F1 and mAP (`METRICS`), then macro-AUROC and balanced accuracy where the runs
recorded them (`TABLE_METRICS`; results of releases before the clinical figures have none).

Where an algorithm keeps BatchNorm at the site (FedBN, FedAH, FedALA with local statistics), Global
is theta^g_T with each site's own BatchNorm (label "Global (site BatchNorm)"). Next to Global the
table has its second reading, "Global (phi_k averaged)": theta^g_T with the sites' phi_k averaged,
which only a simulation can evaluate. Runs of the local baseline (algorithm `local`: each site trains
alone, `trained_alone`) have no theta^g: their Global is the sites' own models pooled (label
"Own models (nothing shared)") and they have no second reading.

Site columns follow the experiment config's order of sites (given by the caller, else as the
results recorded it; results without it: by name). Rows are (method, head split), the splits in
Table I's order from 8:0 to 0:8.

External validation (`external_rows`): each validation site's evaluation of theta^g_T with phi_0 on all
its records (it never trained on them), from the runs' per-round `external` records, mean ± std over seeds.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardiofl.experiment.readings import PHI_K_AVERAGED
from shared.algorithms.exchange import GLOBAL, OWN_MODELS
from shared.evaluation.metrics import TOO_FEW_RECORDS
from shared.model.network import head_ratios
from shared.terms import PrivacyConfig

__all__ = [
    "BASELINE",
    "CLINICAL_COLUMNS",
    "DEFAULT_MIN_RECORDS",
    "GLOBAL_READINGS",
    "METRICS",
    "TABLE_METRICS",
    "Cell",
    "Columns",
    "FinalMetrics",
    "Rows",
    "by_row",
    "effective_heads",
    "external_rows",
    "federated",
    "mean_std",
    "ordered_sites",
    "percent",
    "read_results",
    "split_key",
    "table_rows",
    "trained_alone",
]

METRICS = (("micro_f1", "F1"), ("map", "mAP"))  # FedCVD's figures: the curves' panels, and the tables' first
CLINICAL_COLUMNS = (("macro_auroc", "AUROC"), ("balanced_accuracy", "bal. acc."))  # where the runs recorded them
TABLE_METRICS = (*METRICS, *CLINICAL_COLUMNS)  # each table column's metrics, in order
GLOBAL_READINGS = (GLOBAL, PHI_K_AVERAGED)  # the table's Global columns, the service's reading first
DEFAULT_MIN_RECORDS: int = PrivacyConfig.model_fields["min_records"].default
BASELINE = "8:0"  # Fig. 2's reference split: every head global
_SPLIT_ORDER = {ratio: i for i, ratio in enumerate(head_ratios(8))}  # Table I's order of the fixed splits

Cell = tuple[float, float] | None  # a table cell: mean and std over seeds in percent, None without values
Columns = list[tuple[str, str]]  # (site or Global reading, metric)
Rows = dict[tuple[str, str], dict[str, Any]]  # (method, heads) -> "column:metric" -> Cell, and "seeds" -> count

Curve = list[tuple[int, dict[str, float | None]]]


@dataclass(frozen=True)
class FinalMetrics:
    """One finished run's final numbers and its per-round curve."""

    method: str
    heads: str
    seed: int
    sites: dict[str, dict[str, float | None]]  # site -> personalised summary
    global_: dict[str, float | None]  # pooled theta^g_T
    curve: Curve  # (t, pooled summary of theta^g_t)
    site_curves: dict[str, Curve]  # site -> (t, personalised after round t)
    min_records: int  # the study's privacy.min_records: fewer test records stay out of Global
    too_few: tuple[str, ...]  # sites whose test split was below it in the final evaluation
    global_label: str = GLOBAL  # what Global is: theta^g_T with phi_0, or also with each site's BatchNorm
    global_readings: dict[str, dict[str, float | None]] = field(default_factory=dict)  # label -> pooled summary
    site_order: tuple[str, ...] = ()  # the study's sites in the experiment config's order, when recorded
    # learned_heads: site -> (t, g_{k,b,h} after round t), one list of H gates per block
    gate_curves: dict[str, list[tuple[int, list[list[float]]]]] = field(default_factory=dict)
    planted: dict[str, int] = field(default_factory=dict)  # planted sites: site -> the teacher's H_l^(k)
    external: dict[str, Curve] = field(default_factory=dict)  # validation site -> (t, theta^g_t on all its records)
    # with the experiment's site_readings: (simulated clock, site -> theta^g_t on its test split) per release
    timeline: list[tuple[float, dict[str, dict[str, float | None]]]] = field(default_factory=list)
    site_seconds: dict[str, float] = field(default_factory=dict)  # the experiment's simulated seconds per round

    def summary(self, column: str) -> dict[str, float | None] | None:
        """The summary of a table column: a site (personalised), Global, or another reading of Global."""
        if column == GLOBAL:
            return self.global_
        if column in GLOBAL_READINGS:
            return self.global_readings.get(column)
        return self.sites.get(column)


def trained_alone(run: FinalMetrics) -> bool:
    """Whether `run` is of the local baseline: its sites shared nothing, each trained alone."""
    return run.global_label == OWN_MODELS


def federated(runs: list[FinalMetrics]) -> list[FinalMetrics]:
    """The runs whose sites shared a model (every run but the local baseline's)."""
    return [run for run in runs if not trained_alone(run)]


def _too_few(record: dict[str, Any]) -> tuple[str, ...]:
    """The sites of a round record that reported too few test records for the pooled statistics."""
    reports = record["sites"].items()
    return tuple(sorted(site for site, values in reports if (values["previous_global"] or {}).get(TOO_FEW_RECORDS)))


def _finished_rounds(path: Path) -> list[list[dict[str, Any]]]:
    """The round records of each run's last finished attempt, in round order, in the order the runs finished."""
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
    return [sorted(rounds[attempt], key=lambda r: r["round"]) for attempt in finished.values()]


def _final_metrics(records: list[dict[str, Any]]) -> FinalMetrics:
    """One run from its round records, the last of them its final evaluation."""
    final = records[-1]
    # theta^g_t is evaluated by the sites in round t+1 (or the final evaluation round)
    curve = [(r["round"] - 1, r["previous_global"]) for r in records if r["round"] > 1 and r["previous_global"]]
    site_curves: dict[str, Curve] = defaultdict(list)
    gate_curves: dict[str, list[tuple[int, list[list[float]]]]] = defaultdict(list)
    external: dict[str, Curve] = defaultdict(list)
    for r in records:
        for site, summary in (r.get("external") or {}).items():
            external[site].append((r["round"], summary))
        if r["kind"] == "train":
            for site, values in r["sites"].items():
                if values["local"]:
                    site_curves[site].append((r["round"], values["local"]))
                if values.get("gates") is not None:
                    gate_curves[site].append((r["round"], values["gates"]))
    return FinalMetrics(
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
        planted=final.get("planted_local_heads") or {},
        external=dict(external),
        timeline=[(r["clock"], r["global_by_site"]) for r in records if "clock" in r and "global_by_site" in r],
        site_seconds=final.get("site_seconds") or {},
    )


def read_results(path: Path) -> list[FinalMetrics]:
    """The finished runs in a results file (the last finished attempt of each run)."""
    return [_final_metrics(records) for records in _finished_rounds(path) if records[-1]["kind"] == "evaluate"]


def percent(summary: dict[str, float | None] | None, metric: str) -> float | None:
    """A summary's metric in percent, None when it has none."""
    value = (summary or {}).get(metric)
    return None if value is None else 100.0 * value


def mean_std(values: list[float | None]) -> Cell:
    """The mean and sample std of the values present (std 0 for one), None when none is."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0


def split_key(heads: str) -> tuple[int, str]:
    """A head split's place in Table I's order (8:0 ... 0:8), other splits after them by name."""
    return _SPLIT_ORDER.get(heads, 99), heads


def ordered_sites(runs: list[FinalMetrics], sites: Sequence[str] | None) -> list[str]:
    """The sites with results, in the given (config) order, else as recorded, then any others by name."""
    present = {site for run in runs for site in run.sites}
    listed = list(sites) if sites is not None else next((list(run.site_order) for run in runs if run.site_order), [])
    ordered = [site for site in dict.fromkeys(listed) if site in present]
    return ordered + sorted(present - set(ordered))


def by_row(runs: list[FinalMetrics]) -> dict[tuple[str, str], list[FinalMetrics]]:
    """The runs of each (method, heads), one per seed, in the order the runs came."""
    grouped: dict[tuple[str, str], list[FinalMetrics]] = defaultdict(list)
    for run in runs:
        grouped[(run.method, run.heads)].append(run)
    return grouped


def _recorded(run: FinalMetrics, metric: str) -> bool:
    """Whether a run recorded `metric` for any site or Global reading."""
    summaries = [*run.sites.values(), run.global_, *run.global_readings.values()]
    return any((summary or {}).get(metric) is not None for summary in summaries)


def table_rows(runs: list[FinalMetrics], site_order: Sequence[str] | None = None) -> tuple[list[str], Columns, Rows]:
    """The sites, the columns and each (method, heads) row's cells over seeds, rows in Table I's order."""
    sites = ordered_sites(runs, site_order)
    metrics = [metric for metric, _ in METRICS] + [
        metric for metric, _ in CLINICAL_COLUMNS if any(_recorded(run, metric) for run in runs)
    ]
    columns = [(site, metric) for site in [*sites, *GLOBAL_READINGS] for metric in metrics]
    rows: Rows = {}
    grouped = by_row(runs)
    for key in sorted(grouped, key=lambda k: (k[0], *split_key(k[1]))):
        group = grouped[key]
        cells: dict[str, Any] = {}
        for site, metric in columns:
            cells[f"{site}:{metric}"] = mean_std([percent(r.summary(site), metric) for r in group])
        cells["seeds"] = len(group)
        rows[key] = cells
    return sites, columns, rows


def external_rows(runs: list[FinalMetrics]) -> tuple[list[str], Columns, Rows]:
    """The validation sites, their columns, and each (method, heads) row's cells of theta^g_T over seeds."""
    sites = sorted({site for run in runs for site in run.external})
    finals = {id(run): {site: curve[-1][1] for site, curve in run.external.items() if curve} for run in runs}
    recorded = [summary for final in finals.values() for summary in final.values()]
    metrics = [metric for metric, _ in METRICS] + [
        metric for metric, _ in CLINICAL_COLUMNS if any(summary.get(metric) is not None for summary in recorded)
    ]
    columns = [(site, metric) for site in sites for metric in metrics]
    rows: Rows = {}
    grouped = by_row([run for run in runs if run.external])
    for key in sorted(grouped, key=lambda k: (k[0], *split_key(k[1]))):
        group = grouped[key]
        cells: dict[str, Any] = {
            f"{site}:{metric}": mean_std([percent(finals[id(run)].get(site), metric) for run in group])
            for site, metric in columns
        }
        rows[key] = {**cells, "seeds": len(group)}
    return sites, columns, rows


def effective_heads(runs: list[FinalMetrics]) -> dict[tuple[str, str], list[Cell]]:
    """(method, site) -> per block: the sum of g over heads after the site's last training round, mean and std."""
    sums: dict[tuple[str, str], list[list[float]]] = defaultdict(list)
    for run in runs:
        for site, curve in run.gate_curves.items():
            if curve:
                sums[(run.method, site)].append([sum(block) for block in curve[-1][1]])
    return {
        key: [mean_std([seed[b] for seed in per_seed]) for b in range(max(len(seed) for seed in per_seed))]
        for key, per_seed in sums.items()
    }
