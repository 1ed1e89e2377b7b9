"""Run every benchmark (each prints its own table and writes bench/results/<name>.json), then one summary table.

`--tiny` runs each at a size that only checks it works (seconds, not minutes); `--table-only`
prints the summary of results already written. Every figure is a ratio to a baseline measured
in the same run of that benchmark.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import RESULTS_DIR, print_table

BENCH_DIR = Path(__file__).resolve().parent
BENCHMARKS = (
    "data_loading", "aggregation", "round_overhead", "serving", "secure_round", "scale", "training", "dp_noise",
    "cli_startup", "ray_grid",
)  # fmt: skip
TINY_ARGS = {
    "data_loading": ["--records", "8", "--repeats", "1"],
    "aggregation": ["--presets", "tiny", "--sites", "2", "--repeats", "1", "--copy-mib", "16"],
    "round_overhead": ["--preset", "tiny", "--sites", "2", "--rounds", "2"],
    "serving": ["--megabytes", "3", "--sites", "2", "--repeats", "1"],
    "secure_round": ["--preset", "tiny", "--sites", "3", "--rounds", "2", "--flower-rounds", "2"],
    "scale": ["--sites", "2,3", "--preset", "tiny", "--rounds", "2", "--databases", "sqlite", "--poll-wait", "2"],
    "training": ["--presets", "tiny", "--records", "12", "--batch-size", "4", "--steps", "2", "--repeats", "1"],
    "dp_noise": ["--presets", "tiny", "--repeats", "1"],
    "cli_startup": ["--runs", "1"],
    "ray_grid": ["--grid-runs", "2", "--grid-rounds", "1", "--sites", "2", "--site-rounds", "2", "--records", "30",
                 "--repeats", "1"],
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated benchmarks to run")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes: checks that each runs")
    parser.add_argument("--table-only", action="store_true", help="summarise the JSON results already written")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder of the <name>.json results")
    return parser.parse_args(argv)


def _data_loading(result: dict[str, Any]) -> list[dict[str, Any]]:
    ratio = result["ratio_reparse_over_cache"]
    return [_row("data loading", "cache epoch vs WFDB re-parse", f"{ratio:.1f}x faster", ">= 20x", ratio >= 20)]


def _aggregation(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for preset in dict.fromkeys(row["preset"] for row in result["rows"]):
        mine = [row for row in result["rows"] if row["preset"] == preset]
        worst = min(row["ratio_to_copy"] for row in mine)
        ks = "/".join(str(row["sites"]) for row in mine)
        rows.append(
            _row(
                "aggregation", f"{preset}, K={ks}: read / memory copy", f"{worst:.2f} at worst", ">= 0.5", worst >= 0.5
            )
        )
        peaks = [row["rss_peak_mb"] for row in mine]
        flat = max(peaks) <= 1.1 * min(peaks) + 0.5 * mine[0]["model_mb"]
        rows.append(
            _row(
                "aggregation",
                f"{preset}: peak RSS over K",
                f"{min(peaks):.0f}-{max(peaks):.0f} MB",
                "independent of K",
                flat,
            )
        )
    return rows


def _round_overhead(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    ours = [row for row in result["rows"] if row["system"] == "cardiofl"]
    for row in ours:
        k = row["sites"]
        if "time_over_flower" in row:
            ratio = row["time_over_flower"]
            rows.append(
                _row("round overhead", f"K={k}: s/round ours / Flower", f"{ratio:.3f}", "<= 0.06", ratio <= 0.06)
            )
        wire = row["wire_over_must_move"]
        rows.append(_row("round overhead", f"K={k}: wire / bytes that must move", f"{wire:.2f}", "<= 3", wire <= 3))
    peaks = [row["server_peak_rss"] / 1e6 for row in ours]
    flat = max(peaks) <= 1.1 * min(peaks) + result["model_bytes"] / 2e6
    rows.append(
        _row(
            "round overhead",
            "coordinator peak RSS over K",
            f"{min(peaks):.0f}-{max(peaks):.0f} MB",
            "independent of K",
            flat,
        )
    )
    if result.get("flower_skipped"):
        rows.append(_row("round overhead", "Flower half", "skipped", result["flower_skipped"], None))
    return rows


def _serving(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for row in result["rows"][1:]:
        ratio = row["site_round_vs_views"]
        figure = f"{row['way']} / uvicorn views: server CPU per model sent + received"
        rows.append(_row("serving", figure, "n/a" if ratio is None else f"{ratio:.2f}", "choose the lowest", None))
    for way, why in result["skipped"].items():
        rows.append(_row("serving", way, "skipped", why, None))
    return rows


def _secure_round(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for row in result["rows"]:
        if (row["system"], row["mode"]) != ("cardiofl", "secure"):
            continue
        k, over_plain = row["sites"], row["secure_over_plain"]
        figure = f"K={k}: s/round secure / plain"
        rows.append(_row("secure round", figure, f"{over_plain:.2f}", "<= 2", over_plain <= 2.0))
        if "secure_over_flower_secure" in row:
            ratio = row["secure_over_flower_secure"]
            figure = f"K={k}: secure s/round ours / Flower SecAgg+"
            rows.append(_row("secure round", figure, f"{ratio:.3f}", "<= 0.5", ratio <= 0.5))
    for key, what in (("secure_skipped", "secure rounds"), ("flower_skipped", "Flower half")):
        if result.get(key):
            rows.append(_row("secure round", what, "skipped", result[key], None))
    return rows


def _scale(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for database in dict.fromkeys(row["database"] for row in result["rows"]):
        mine = sorted((row for row in result["rows"] if row["database"] == database), key=lambda row: row["sites"])
        ks = "/".join(str(row["sites"]) for row in mine)
        if not all(row.get("completed", True) for row in mine):
            rows.append(_row("cost in K", f"{database}, K={ks}", "a K did not finish", "every K finishes", False))
            continue
        low, high = mine[0], mine[-1]
        growth = high["cpu_s_per_site"] / low["cpu_s_per_site"]
        figure = f"{database}, K={high['sites']} over K={low['sites']}: CPU per site"
        rows.append(_row("cost in K", figure, f"{growth:.2f}x", "<= 1.5x", growth <= 1.5))
        errors = sum(row["errors"] for row in mine)
        rows.append(_row("cost in K", f"{database}, K={ks}: errors", str(errors), "0", errors == 0))
        status = high["status_p99_s"]
        figure = f"{database}, K={high['sites']}: GET /status p99"
        rows.append(_row("cost in K", figure, f"{status:.2f} s", "< 1 s", status is not None and status < 1.0))
    return rows


def _training(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _row(
            "site training",
            f"{row['preset']} ({row['device']}): loop over bare fwd/bwd",
            f"{row['overhead_percent']:+.1f}%",
            "<= 5%",
            row["overhead_percent"] <= 5.0,
        )
        for row in result["rows"]
    ]


def _dp_noise(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _row(
            "DP noise",
            f"{row['preset']}: exact discrete / float normal",
            f"{row['discrete_per_normal']:.1f}x",
            "-",
            None,
        )
        for row in result["rows"]
    ]


def _cli_startup(result: dict[str, Any]) -> list[dict[str, Any]]:
    seconds, target = result["version_median_s"], result["target_version_s"]
    return [
        _row("CLI startup", "cardiofl --version, median wall", f"{seconds:.2f} s", f"< {target} s", seconds < target)
    ]


def _ray_grid(result: dict[str, Any]) -> list[dict[str, Any]]:
    grid, sites = result["grid"], result["sites"]
    ratio, speedup = grid["ratio"], sites["speedup"]
    return [
        _row("Ray", f"{grid['runs']}-run grid: Ray / local --jobs 2", f"{ratio:.2f}", "<= 1.10", ratio <= 1.10),
        _row(
            "Ray",
            f"K={sites['sites']}: round, sites as tasks vs in turn",
            f"{speedup:.2f}x",
            ">= 1.7x",
            speedup >= 1.7 and sites["theta_identical"],
        ),
    ]


SUMMARIES: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "data_loading": _data_loading,
    "aggregation": _aggregation,
    "round_overhead": _round_overhead,
    "serving": _serving,
    "secure_round": _secure_round,
    "scale": _scale,
    "training": _training,
    "dp_noise": _dp_noise,
    "cli_startup": _cli_startup,
    "ray_grid": _ray_grid,
}


def _row(benchmark: str, figure: str, measured: str, target: str, met: bool | None) -> dict[str, Any]:
    return {"benchmark": benchmark, "figure": figure, "measured": measured, "target": target, "met": _verdict(met)}


def _verdict(met: bool | None) -> str:
    return "" if met is None else "yes" if met else "NO"


def summary(names: list[str], results: Path) -> list[dict[str, Any]]:
    """The summary rows of the benchmarks `names` from their JSON files in `results`."""
    rows = []
    for name in names:
        path = results / f"{name}.json"
        if not path.exists():
            rows.append(_row(name.replace("_", " "), "no results", f"{path} missing", "", None))
            continue
        rows.extend(SUMMARIES[name](json.loads(path.read_text())))
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the chosen benchmarks, then print the summary table."""
    args = parse_args(argv)
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; choose from {', '.join(BENCHMARKS)}")
    if not args.table_only:
        for name in names:
            print(f"\n=== {name}", flush=True)
            extra = TINY_ARGS[name] if args.tiny else []
            command = [
                sys.executable,
                str(BENCH_DIR / f"{name}.py"),
                *extra,
                "--out",
                str(args.results / f"{name}.json"),
            ]
            subprocess.run(command, check=True)
    rows = summary(names, args.results)
    print("\n=== summary")
    print_table(
        rows,
        [
            ("benchmark", "benchmark"),
            ("figure", "figure"),
            ("measured", "measured"),
            ("target", "target"),
            ("met", "met"),
        ],
    )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
