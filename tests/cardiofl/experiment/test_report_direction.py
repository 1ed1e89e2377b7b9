"""The report's check of the paper's direction: local heads raise per-site F1, 0:8 lowers Global, spread marked."""

from __future__ import annotations

import json
from pathlib import Path

from cardiofl.experiment.claims import LOWERED, RAISED, WITHIN, compare
from cardiofl.experiment.report import write_report

# heads -> per seed: (site-a F1, site-b F1, Global F1), fractions
Runs = dict[str, list[tuple[float, float, float]]]


def results_file(path: Path, runs: Runs) -> Path:
    """A results file of finished FedDualAtt runs with these per-site and Global micro-F1s."""
    lines = []
    for heads, seeds in runs.items():
        for seed, (a, b, pooled) in enumerate(seeds):
            run, attempt = f"FedDualAtt|{heads}|{seed}", f"{heads}-{seed}"
            sites = {
                name: {"local": {"micro_f1": f1, "map": f1}, "previous_global": {}}
                for name, f1 in zip("ab", (a, b), strict=True)
            }
            record = {
                "type": "round",
                "run": run,
                "attempt": attempt,
                "method": "FedDualAtt",
                "heads": heads,
                "seed": seed,
                "round": 2,
                "kind": "evaluate",
                "sites": sites,
                "site_order": ["b", "a"],
                "previous_global": {"micro_f1": pooled, "map": pooled},
                "global_readings": {},
            }
            lines += [json.dumps(record), json.dumps({"type": "run_done", "run": run, "attempt": attempt})]
    path.write_text("\n".join(lines) + "\n")
    return path


def direction_section(tmp_path: Path, runs: Runs) -> list[str]:
    """The lines of table.md's direction section."""
    text = write_report(results_file(tmp_path / "results.jsonl", runs), tmp_path / "report")["table.md"].read_text()
    return text.split("## The paper's direction (Fig. 2)", 1)[1].strip().splitlines()


def test_compare_marks_a_difference_within_the_sum_of_the_stds() -> None:
    assert compare((45.0, 2.0), (40.0, 2.0)) == (5.0, RAISED)
    assert compare((44.0, 2.0), (40.0, 2.0)) == (4.0, WITHIN)  # |4.0| <= 2.0 + 2.0: the seeds cannot tell
    assert compare((30.0, 1.0), (40.0, 2.0)) == (-10.0, LOWERED)
    assert compare((40.0, 0.0), (40.0, 0.0)) == (0.0, WITHIN)


def test_the_section_states_each_finding_with_numbers_and_marks(tmp_path: Path) -> None:
    runs = {
        "8:0": [(0.40, 0.50, 0.60), (0.42, 0.50, 0.62)],  # a 41.0±1.4, b 50.0±0.0, Global 61.0±1.4
        "6:2": [(0.50, 0.51, 0.55), (0.52, 0.49, 0.57)],  # a +10 raised, b +0 within spread
        "0:8": [(0.48, 0.40, 0.30), (0.50, 0.40, 0.32)],  # a +8 raised, b -10 lowered; Global -30 lowered
    }
    lines = direction_section(tmp_path, runs)
    by_site = {line.split("'s F1")[0].removeprefix("- Local heads raise "): line for line in lines if "'s F1" in line}
    assert list(by_site) == ["b", "a"]  # the config's order of sites
    assert by_site["a"] == (
        "- Local heads raise a's F1: holds. 8:0 41.0±1.4; 6:2 +10.0 raised, 0:8 +8.0 raised "
        "(2 raised, 0 within spread, 0 lowered)."
    )
    assert by_site["b"].startswith(
        "- Local heads raise b's F1: partly reversed (lowered in 1 of 2 splits). 8:0 50.0±0.0; 6:2 +0.0 within spread, "
    )
    assert "0:8 −10.0 lowered" in by_site["b"]
    (pooled,) = [line for line in lines if line.startswith("- 0:8 lowers Global F1")]
    assert pooled.startswith("- 0:8 lowers Global F1: holds. 8:0 61.0±1.4, 0:8 31.0±1.4 (−30.0 pp, lowered)")
    assert "Per-site: the paper's direction holds at 1 of 2 sites, partly at 0." in lines


def test_differences_within_the_spread_are_not_called_findings(tmp_path: Path) -> None:
    runs = {
        "8:0": [(0.40, 0.40, 0.50), (0.50, 0.50, 0.60)],  # 45.0±7.1 everywhere, Global 55.0±7.1
        "0:8": [(0.45, 0.45, 0.45), (0.55, 0.55, 0.55)],  # +5.0, within 14.2
    }
    lines = direction_section(tmp_path, runs)
    assert (
        sum(
            "F1: not shown (within the seeds' spread; 1 of 1 splits higher). 8:0 45.0±7.1; 0:8 +5.0 within spread" in x
            for x in lines
        )
        == 2
    )
    (pooled,) = [line for line in lines if line.startswith("- 0:8 lowers Global F1")]
    assert pooled.startswith(
        "- 0:8 lowers Global F1: not shown (within the seeds' spread; lower at 0:8). 8:0 55.0±7.1, 0:8 50.0±7.1"
    )
    assert "Per-site: the paper's direction holds at 0 of 2 sites, partly at 0." in lines


def test_no_section_without_an_8_0_row(tmp_path: Path) -> None:
    path = results_file(tmp_path / "results.jsonl", {"6:2": [(0.5, 0.5, 0.5)], "0:8": [(0.4, 0.4, 0.4)]})
    assert "paper's direction" not in write_report(path, tmp_path / "report")["table.md"].read_text()


def test_a_site_scoring_zero_everywhere_is_called_not_measurable(tmp_path: Path) -> None:
    runs = {
        "8:0": [(0.0, 0.40, 0.50), (0.0, 0.40, 0.50)],
        "7:1": [(0.0, 0.50, 0.50), (0.0, 0.52, 0.50)],  # b +11 raised
        "6:2": [(0.0, 0.38, 0.50), (0.0, 0.40, 0.50)],  # b -1 within spread
        "5:3": [(0.0, 0.40, 0.50), (0.0, 0.42, 0.50)],  # b +1 within spread
    }
    lines = direction_section(tmp_path, runs)
    assert any(line.startswith("- Local heads raise a's F1: not measurable (F1 0.0 at every split).") for line in lines)
    assert any(
        line.startswith("- Local heads raise b's F1: partly (raised beyond the spread in 1 of 3 splits).")
        for line in lines
    )
    assert "Per-site: the paper's direction holds at 0 of 2 sites, partly at 1." in lines
    assert not any("lowers Global" in line for line in lines)  # no 0:8 row: nothing said about it


def test_a_split_with_one_seed_is_not_judged(tmp_path: Path) -> None:
    runs = {"8:0": [(0.40, 0.40, 0.50), (0.40, 0.40, 0.50)], "0:8": [(0.60, 0.20, 0.30)]}
    lines = direction_section(tmp_path, runs)
    assert any(
        line.startswith("- Local heads raise a's F1: not judged (one seed). 8:0 40.0±0.0; 0:8 +20.0 one seed")
        for line in lines
    )
    assert any(line.startswith("- 0:8 lowers Global F1: not judged (one seed).") for line in lines)
