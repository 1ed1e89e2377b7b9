"""Benchmark: how long the `cardiofl` command takes to answer, against `python -c "import torch"` in the same run.

Times, as wall seconds of a fresh process each (`--runs` of each, median and p90):
- `cardiofl --version`, `cardiofl --help`, `cardiofl study list --help`, `cardiofl site list --help`:
  the command line loads torch, numpy and the coordinator's server only in the commands that need them;
- `cardiofl study list`, `study show 1`, `study watch 1`, `site list` against a live coordinator on
  SQLite (started here, one study enrolled with two sites, cancelled so that `watch` returns): the
  read commands, request and answer included;
- `python -c "import torch"`: the baseline, what every command paid before they were imported on demand;
- `python -c "pass"`: the interpreter's own start, the floor under every figure.
Prints the table, each command's ratio to the torch import, and the target (`--version` under 0.5 s);
writes JSON (default bench/results/cli_startup.json).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
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
READS = ["study list", "study show 1", "study watch 1", "site list"]  # against the live coordinator
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


@contextmanager
def live_coordinator() -> Iterator[tuple[str, str]]:
    """A coordinator on a fresh SQLite database with one cancelled study of two sites: its URL and admin token."""
    from coordinator.config import generate_admin_token

    with tempfile.TemporaryDirectory() as folder, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port, token = probe.getsockname()[1], generate_admin_token()
        probe.close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")}
        env |= {"CARDIOFL_DATABASE_URL": f"sqlite:///{folder}/coordinator.db", "CARDIOFL_ADMIN_TOKEN": token}
        serve = [*CARDIOFL, "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port)]
        server = subprocess.Popen(serve, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as admin:
                _wait_healthy(admin, server)
                for name in ("lyon", "oslo"):
                    admin.post("/api/v1/sites", json={"name": name}).raise_for_status()
                config = {"sites": ["lyon", "oslo"], "rounds": 2, "min_sites": 2, "model": {"preset": "tiny"}}
                study = admin.post("/api/v1/studies", json={"name": "startup", "config": config})
                admin.post(f"/api/v1/studies/{study.raise_for_status().json()['id']}/cancel").raise_for_status()
            yield url, token
        finally:
            server.terminate()
            server.wait(30)


def _wait_healthy(admin: httpx.Client, server: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Until the coordinator answers its health check; RuntimeError if it exits or takes longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if admin.get("/api/v1/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the coordinator did not start")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Time every command and the baselines, print the table and the ratios, write the JSON; return the results."""
    args = parse_args(argv)
    with live_coordinator() as (url, token):
        reads = {f"cardiofl {read}": [*CARDIOFL, *read.split(), "--url", url, "--token", token] for read in READS}
        rows = measure({**COMMANDS, **reads, **BASELINES}, args.runs)
    torch_s = rows[len(COMMANDS) + len(reads)]["median_s"]
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
    slowest_read = max(rows[len(COMMANDS) : len(COMMANDS) + len(reads)], key=lambda row: row["median_s"])
    results = {
        "settings": vars(args),
        "target_version_s": TARGET_S,
        "version_median_s": version_s,
        "version_met": version_s < TARGET_S,
        "slowest_read": slowest_read["command"],
        "slowest_read_median_s": slowest_read["median_s"],
        "reads_met": slowest_read["median_s"] < TARGET_S,
        "rows": rows,
    }
    write_results(Path(args.out), results)
    print(f"cardiofl --version: median {version_s:.3f} s, target < {TARGET_S} s")
    print(f"slowest read command: {slowest_read['command']}, median {slowest_read['median_s']:.3f} s")
    print(f"ratio cardiofl --version over import torch: {rows[0]['over_import_torch']}")
    return results


if __name__ == "__main__":
    main()
