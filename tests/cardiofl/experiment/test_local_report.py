"""The report's local baseline: each site's model trained alone beside its federated ones (DataTools4Heart Fig. 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cardiofl.experiment.figures import local_vs_federated_figure, site_metric
from cardiofl.experiment.report import build_report
from cardiofl.experiment.results import read_results, trained_alone
from shared.algorithms.exchange import GLOBAL, OWN_MODELS

# (method, heads) -> per seed: site a's and b's (micro-F1, macro AUROC); Local's runs are written first
GRID = {
    ("Local", "8:0"): [((0.20, 0.60), (0.30, 0.70)), ((0.22, 0.62), (0.32, 0.72))],
    ("FedDualAtt", "8:0"): [((0.40, 0.80), (0.50, 0.75)), ((0.42, 0.82), (0.52, 0.77))],
    ("FedDualAtt", "6:2"): [((0.45, 0.81), (0.55, 0.79)), ((0.47, 0.83), (0.57, 0.81))],
    ("FedProx", "6:2"): [((0.41, 0.70), (0.51, 0.71)), ((0.43, 0.72), (0.53, 0.73))],  # no 8:0 run
}


def results_file(path: Path, *, auroc: bool = True) -> Path:
    """A results file of finished runs with these final per-site figures, with or without `macro_auroc`."""
    lines = []
    for (method, heads), seeds in GRID.items():
        label = OWN_MODELS if method == "Local" else GLOBAL
        for seed, per_site in enumerate(seeds):
            run, attempt = f"{method}|{heads}|{seed}", f"{method}-{heads}-{seed}"
            sites = {
                name: {"local": {"micro_f1": f1, "map": f1, **({"macro_auroc": area} if auroc else {})}}
                for name, (f1, area) in zip("ab", per_site, strict=True)
            }
            for values in sites.values():
                values["previous_global"] = {}
            final = {"type": "round", "run": run, "attempt": attempt, "method": method, "heads": heads, "seed": seed}
            pooled = {"micro_f1": 0.3, "map": 0.3}
            final |= {"round": 2, "kind": "evaluate", "sites": sites, "site_order": ["a", "b"]}
            final |= {"previous_global": pooled, "global_readings": {}, "global_label": label}
            lines += [json.dumps(final), json.dumps({"type": "run_done", "run": run, "attempt": attempt})]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("auroc", "metric", "label"), [(True, 1, "macro AUROC"), (False, 0, "micro-F1")])
def test_each_site_s_model_alone_stands_beside_each_federated_method(
    tmp_path: Path, auroc: bool, metric: int, label: str
) -> None:
    runs = read_results(results_file(tmp_path / "results.jsonl", auroc=auroc))
    assert [run.method for run in runs if trained_alone(run)] == ["Local", "Local"]
    assert site_metric(runs, ["a", "b"])[1] == label
    figure = local_vs_federated_figure(runs, ["a", "b"])
    assert figure is not None
    (axis,) = figure.axes
    assert axis.get_ylabel() == f"{label} (%), mean ± std over seeds"
    assert [tick.get_text() for tick in axis.get_xticklabels()] == ["a", "b"]
    # Local and the federated methods at its split, or at every split where a method has none at it
    bars = {container.get_label(): container for container in axis.containers if hasattr(container, "patches")}
    assert list(bars) == ["Local 8:0 (trained alone)", "FedDualAtt 8:0", "FedProx 6:2"]
    for (method, heads), seeds in GRID.items():
        name = f"{method} {heads}" + (" (trained alone)" if method == "Local" else "")
        if name not in bars:
            continue
        means = [100 * (seeds[0][site][metric] + seeds[1][site][metric]) / 2 for site in (0, 1)]
        assert [patch.get_height() for patch in bars[name].patches] == pytest.approx(means)


def test_no_figure_without_both_sides_of_the_comparison(tmp_path: Path) -> None:
    runs = read_results(results_file(tmp_path / "results.jsonl"))
    assert local_vs_federated_figure([run for run in runs if trained_alone(run)], ["a", "b"]) is None
    assert local_vs_federated_figure([run for run in runs if not trained_alone(run)], ["a", "b"]) is None


def test_the_report_notes_the_local_baseline_and_judges_the_paper_s_direction_on_federated_runs(
    tmp_path: Path,
) -> None:
    report = build_report(results_file(tmp_path / "results.jsonl"))
    assert set(report.figures) == {"curves", "head_ratio_deltas", "local_vs_federated"}
    deltas = report.figures["head_ratio_deltas"].axes
    assert deltas[0].get_title() == "FedDualAtt: F1"  # not Local's 8:0, although its runs came first
    assert "| Local | 8:0 |" in report.markdown
    assert f"{OWN_MODELS}: Local shared nothing (each site trained alone)" in report.markdown
    assert "### Local" not in report.markdown and "### FedDualAtt" in report.markdown
    saved = report.save(tmp_path / "report")
    assert saved["local_vs_federated.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
