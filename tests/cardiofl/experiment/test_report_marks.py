"""Table I's marks in the report (bold best, underlined second-best, ties, seeds' spread) and its site column order."""

from __future__ import annotations

import json
from pathlib import Path

from cardiofl.experiment.config import ExperimentConfig
from cardiofl.experiment.report import write_report

SITES = ("sph", "g12ec", "ptbxl")

# (method, heads) -> one site's micro-F1 per seed (a fraction); mAP and the other sites copy it
Scores = dict[tuple[str, str], list[float]]


def results_file(
    path: Path,
    f1: Scores,
    *,
    sites: tuple[str, ...] = SITES,
    site_order: list[str] | None = None,
    clinical: bool = False,
) -> Path:
    """A results file of finished runs whose every site and Global score `f1` (seed i: the i-th value).

    `clinical`: with macro-AUROC (F1 + 0.15) and balanced accuracy (F1 - 0.05) too; without, as before them.
    """
    lines = []
    for (method, heads), values in f1.items():
        for seed, value in enumerate(values):
            run, attempt = f"{method}|{heads}|{seed}", f"{method}-{heads}-{seed}"
            summary = {"micro_f1": value, "map": value}
            if clinical:
                summary |= {"macro_auroc": value + 0.15, "balanced_accuracy": value - 0.05}
            record = {
                "type": "round",
                "run": run,
                "attempt": attempt,
                "method": method,
                "heads": heads,
                "seed": seed,
                "round": 2,
                "kind": "evaluate",
                "sites": {site: {"local": summary, "previous_global": summary} for site in sites},
                "previous_global": summary,
                "global_readings": {},
            }
            if site_order is not None:
                record["site_order"] = site_order
            done = {"type": "run_done", "run": run, "attempt": attempt}
            lines += [json.dumps(record, sort_keys=True), json.dumps(done)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def tables(markdown: str) -> list[dict[tuple[str, str], dict[str, str]]]:
    """Each Markdown table of a report: (method, heads) -> column header -> cell."""
    found: list[dict[tuple[str, str], dict[str, str]]] = []
    header: list[str] = []
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if not header:
            header = cells
            found.append({})
        elif not line.startswith("|---"):
            found[-1][(cells[0], cells[1])] = dict(zip(header, cells, strict=True))
    return found


def report(tmp_path: Path, f1: Scores, site_order: list[str] | None = None) -> str:
    """The table.md of a report on `f1`."""
    results = results_file(tmp_path / "results.jsonl", f1, site_order=site_order)
    return write_report(results, tmp_path / "report")["table.md"].read_text()


def column(table: dict[tuple[str, str], dict[str, str]], name: str) -> dict[str, str]:
    """One column of a table by method."""
    return {method: cells[name] for (method, _), cells in table.items()}


def test_best_is_bold_and_second_best_underlined_in_every_column(tmp_path: Path) -> None:
    (table,) = tables(report(tmp_path, {("A", "8:0"): [0.6], ("B", "8:0"): [0.8], ("C", "8:0"): [0.7]}))
    for name in ("sph F1", "sph mAP", "g12ec F1", "ptbxl mAP", "Global F1", "Global mAP"):
        assert column(table, name) == {"A": "60.0±0.0", "B": "**80.0±0.0**", "C": "<u>70.0±0.0</u>"}
    assert column(table, "Global (phi_k averaged) F1") == {"A": "–", "B": "–", "C": "–"}


def test_macro_auroc_and_balanced_accuracy_are_columns_where_the_runs_recorded_them(tmp_path: Path) -> None:
    grid = {("A", "8:0"): [0.6, 0.62], ("B", "8:0"): [0.8, 0.8], ("C", "8:0"): [0.7, 0.7]}
    results = results_file(tmp_path / "results.jsonl", grid, clinical=True)
    written = write_report(results, tmp_path / "report")
    markdown = written["table.md"].read_text()
    (table,) = tables(markdown)
    header = markdown.splitlines()[0].split(" | ")
    assert header[2:6] == ["g12ec F1", "g12ec mAP", "g12ec AUROC", "g12ec bal. acc."]  # after FedCVD's, per column
    for site in ("sph", "ptbxl", "Global"):
        assert column(table, f"{site} AUROC") == {"A": "76.0±1.4", "B": "**95.0±0.0**", "C": "<u>85.0±0.0</u>"}
        assert column(table, f"{site} bal. acc.") == {"A": "56.0±1.4", "B": "**75.0±0.0**", "C": "<u>65.0±0.0</u>"}
    assert column(table, "Global (phi_k averaged) AUROC") == {"A": "–", "B": "–", "C": "–"}
    assert "AUROC: macro-AUROC; bal. acc.: balanced accuracy at 0.5" in markdown
    rows = written["table.csv"].read_text().splitlines()
    names = rows[0].split(",")
    assert names.index("Global_macro_auroc_mean") == names.index("Global_map_std") + 1
    values = dict(zip(names, rows[1].split(","), strict=True))
    assert (values["method"], values["Global_macro_auroc_mean"], values["sph_balanced_accuracy_std"]) == (
        "A",
        "76.0000",
        "1.4142",
    )
    # results written before the clinical figures: FedCVD's columns alone, and no note about the others
    old = write_report(results_file(tmp_path / "old.jsonl", grid), tmp_path / "old")["table.md"].read_text()
    assert "AUROC" not in old and "bal. acc." not in old


def test_equal_printed_means_share_their_mark(tmp_path: Path) -> None:
    scores = {
        ("A", "8:0"): [0.875],
        ("B", "8:0"): [0.87504],  # prints as 87.5 too: tied with A for best
        ("C", "8:0"): [0.8],
        ("D", "8:0"): [0.80001],  # tied with C for second-best
        ("E", "8:0"): [0.7],
    }
    (table,) = tables(report(tmp_path, scores))
    assert column(table, "sph F1") == {
        "A": "**87.5±0.0**",
        "B": "**87.5±0.0**",
        "C": "<u>80.0±0.0</u>",
        "D": "<u>80.0±0.0</u>",
        "E": "70.0±0.0",
    }


def test_a_lead_within_the_seeds_spread_gets_the_dagger(tmp_path: Path) -> None:
    close = {("A", "8:0"): [0.78, 0.82], ("B", "8:0"): [0.785, 0.795], ("C", "8:0"): [0.5, 0.5]}
    (table,) = tables(report(tmp_path / "close", close))
    # 80.0±2.8 leads 79.0±0.7 by 1.0 < 2.8 + 0.7: bold, but flagged as no clear winner
    assert column(table, "sph F1") == {"A": "**80.0±2.8**†", "B": "<u>79.0±0.7</u>", "C": "50.0±0.0"}

    apart = {("A", "8:0"): [0.78, 0.82], ("B", "8:0"): [0.7, 0.7]}
    (table,) = tables(report(tmp_path / "apart", apart))
    assert column(table, "sph F1") == {"A": "**80.0±2.8**", "B": "<u>70.0±0.0</u>"}


def test_a_lead_equal_to_the_printed_spread_counts_as_within_it(tmp_path: Path) -> None:
    touching = {("A", "8:0"): [0.79, 0.80, 0.81], ("B", "8:0"): [0.77, 0.78, 0.79]}
    (table,) = tables(report(tmp_path / "touching", touching))
    # 80.0±1.0 and 78.0±1.0: the printed ranges meet at 79.0
    assert column(table, "sph F1") == {"A": "**80.0±1.0**†", "B": "<u>78.0±1.0</u>"}

    apart = {("A", "8:0"): [0.79, 0.80, 0.81], ("B", "8:0"): [0.769, 0.779, 0.789]}
    (table,) = tables(report(tmp_path / "apart", apart))
    assert column(table, "sph F1") == {"A": "**80.0±1.0**", "B": "<u>77.9±1.0</u>"}


def test_plain_resnet_rows_and_hybrid_rows_are_ranked_jointly_as_table_i_does(tmp_path: Path) -> None:
    scores = {
        ("FedAvg", "-"): [0.5],
        ("FedProx", "-"): [0.55],
        ("FedDualAtt", "8:0"): [0.8],
        ("FedDualAtt", "7:1"): [0.7],
        ("FedDualAtt", "6:2"): [0.75],
    }
    plain, hybrid = tables(report(tmp_path, scores))
    assert column(plain, "sph F1") == {"FedAvg": "50.0±0.0", "FedProx": "55.0±0.0"}  # beaten by hybrid rows
    assert {heads: cells["sph F1"] for (_, heads), cells in hybrid.items()} == {
        "8:0": "**80.0±0.0**",
        "7:1": "70.0±0.0",
        "6:2": "<u>75.0±0.0</u>",
    }


def test_site_columns_follow_the_config_order(tmp_path: Path) -> None:
    config = ExperimentConfig.model_validate(
        {
            "name": "order",
            "sites": [{"name": site, "data": [{"kind": "challenge", "path": f"/data/{site}"}]} for site in SITES],
        }
    )
    results = results_file(tmp_path / "results.jsonl", {("A", "8:0"): [0.6], ("B", "8:0"): [0.7]})
    written = write_report(results, tmp_path / "report", sites=config.site_names())
    header = written["table.md"].read_text().splitlines()[0]
    assert header.split(" | ")[2:8] == ["sph F1", "sph mAP", "g12ec F1", "g12ec mAP", "ptbxl F1", "ptbxl mAP"]
    assert "Sites: sph, g12ec, ptbxl." in written["table.md"].read_text()
    csv_header = written["table.csv"].read_text().splitlines()[0].split(",")
    assert [name for name in csv_header if name.endswith("_micro_f1_mean")][:3] == [
        "sph_micro_f1_mean",
        "g12ec_micro_f1_mean",
        "ptbxl_micro_f1_mean",
    ]


def test_site_columns_follow_the_order_the_results_recorded(tmp_path: Path) -> None:
    markdown = report(tmp_path, {("A", "8:0"): [0.6]}, site_order=["ptbxl", "sph", "g12ec"])
    assert "Sites: ptbxl, sph, g12ec." in markdown


def test_without_an_order_site_columns_go_by_name_and_unlisted_sites_come_last(tmp_path: Path) -> None:
    assert "Sites: g12ec, ptbxl, sph." in report(tmp_path / "none", {("A", "8:0"): [0.6]})
    results = results_file(tmp_path / "results.jsonl", {("A", "8:0"): [0.6]})
    written = write_report(results, tmp_path / "report", sites=["ptbxl", "sxph"])  # sxph has no results
    assert "Sites: ptbxl, g12ec, sph." in written["table.md"].read_text()
