"""Benchmark: how long the `cardiofl` command takes to answer, against `python -c "import torch"` in the same run.

Times, as wall seconds of a fresh process each (`--runs` of each, median and p90):
- `cardiofl --version`, `cardiofl --help`, `cardiofl study list --help`, `cardiofl site list --help`:
  the command line loads torch, numpy and the coordinator's server only in the commands that need them;
- `python -c "import torch"`: the baseline, what every command paid before they were imported on demand;
- `python -c "pass"`: the interpreter's own start, the floor under every figure.
Prints the table, each command's ratio to the torch import, and the target (`--version` under 0.5 s);
writes JSON (default bench/results/cli_startup.json).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import RESULTS_DIR, print_table, write_results

DEFAULT_OUT = RESULTS_DIR / "cli_startup.json"
TARGET_S = 0.5  # `cardiofl --version` answers at once
CARDIOFL = [sys.executable, "-m", "cardiofl"]
COMMANDS = {
    "cardiofl --version": [*CARDIOFL, "--version"],
    "cardiofl --help": [*CARDIOFL, "--help"],
    "cardiofl study list --help": [*CARDIOFL, "study", "list", "--help"],
    "cardiofl site list --help": [*CARDIOFL, "site", "list", "--help"],
}
BASELINES = {
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    'python -c "pass"': [sys.executable, "-c", "pass"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command (default 5)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    return parser.parse_args(argv)


def wall_seconds(command: list[str]) -> float:
    """Wall time of one run of `command` to its exit; a failure stops the benchmark."""
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - start


def p90(values: list[float]) -> float:
    """The 90th percentile (linear between the nearest ranks)."""
    ordered = sorted(values)
    position = 0.9 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measure(commands: dict[str, list[str]], runs: int) -> list[dict[str, Any]]:
    """One row per command: its runs, median and p90; the commands take turns so that drift hits each alike."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, command in commands.items():
            times[name].append(wall_seconds(command))
    return [
        {
            "command": name,
            "runs_s": [round(t, 4) for t in spent],
            "median_s": round(statistics.median(spent), 4),
            "p90_s": round(p90(spent), 4),
        }
        for name, spent in times.items()
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Time every command and the baselines, print the table and the ratios, write the JSON; return the results."""
    args = parse_args(argv)
    rows = measure({**COMMANDS, **BASELINES}, args.runs)
    torch_s = rows[len(COMMANDS)]["median_s"]
    for row in rows:
        row["over_import_torch"] = round(row["median_s"] / torch_s, 3)
    print_table(
        rows,
        [
            ("command", "command"),
            ("median_s", "median s"),
            ("p90_s", "p90 s"),
            ("over_import_torch", "/ import torch"),
        ],
    )
    version_s = rows[0]["median_s"]
    results = {
        "settings": vars(args),
        "target_version_s": TARGET_S,
        "version_median_s": version_s,
        "version_met": version_s < TARGET_S,
        "rows": rows,
    }
    write_results(Path(args.out), results)
    print(f"cardiofl --version: median {version_s:.3f} s, target < {TARGET_S} s")
    print(f"ratio cardiofl --version over import torch: {rows[0]['over_import_torch']}")
    return results


if __name__ == "__main__":
    main()
