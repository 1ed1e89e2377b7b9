"""Benchmark: one trained round of an N MB theta^g with 3 real site agents, plain and secure, against memory bounds.

The model is bench/big_model.py's plug-in preset `bench_big`: the `small` network with its token
width D set to --width (default 1024; `small` has 128), no dropout, and its feed-forward layers
widened until theta^g, float32, is about N MB. The width keeps what training holds besides the
tensors small: a feed-forward layer's activations per record are T / (2 D) of its weights (T = 157
tokens), 0.61 x theta^g at D = 128 and 0.08 x at 1024. `cardiofl coordinator serve` (SQLite) and 3
`cardiofl site run` agents, each with a few synthetic records (site_agent/data/synthetic.py), run a
study of one round of local training (plain SGD, momentum 0, one step of a small batch) and its
final evaluation; with --secure a second coordinator and 3 new agents run the same study under
secure aggregation (`[privacy] secure_aggregation`: masked uploads).

Each process's peak resident memory is its VmHWM (/proc) at the end; its constant is its VmRSS
once the agents have approved the study, before it starts. The bounds: the coordinator's peak at
most 3 x theta^g above its constant (whatever K), each agent's at most 4 x theta^g above its own.
Prints, per mode, each peak in MB and as a multiple of theta^g over the constant, the wall time, and
how many transfer progress lines the agents logged; exits 1 when a bound is exceeded. Writes JSON
(default bench/results/big_round.json), with each process's resident memory sampled every 0.25 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import RESULTS_DIR, in_workdir, memory_of, write_results
from big_model import PRESET, checked, install_plugin, sized, start_coordinator
from round_overhead import stop, wait_until

DEFAULT_OUT = RESULTS_DIR / "big_round.json"
SITES = 3
COORDINATOR_BOUND = 3.0  # peak - constant <= this many theta^g
AGENT_BOUND = 4.0
SAMPLE_S = 0.25
MODES = ("plain", "secure")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=1024.0, help="size of theta^g in MB (default 1024)")
    parser.add_argument("--secure", action="store_true", help="after the plain round, a secure one")
    parser.add_argument("--modes", help="comma-separated modes to run, of plain and secure (overrides --secure)")
    parser.add_argument("--records", type=int, default=24, help="synthetic records per site (default 24)")
    parser.add_argument("--batch-size", type=int, default=2, help="local batch size (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="token width D of the network (default 1024)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for each study")
    parser.add_argument("--no-bounds", action="store_true", help="exit 0 even when a peak exceeds its bound")
    parser.add_argument("--workdir", type=Path, help="where databases, data, stores and logs go (default: temporary)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",") if args.modes else ["plain", *(["secure"] if args.secure else [])]
    if not args.modes or any(mode not in MODES for mode in args.modes):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    return args


class Sampler:
    """Every SAMPLE_S seconds, the resident memory of some processes, until stopped."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self.began = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, name: str, pid: int) -> None:
        """Sample process `pid` as `name` from now on."""
        self.samples[name] = []
        self.pids[name] = pid

    def close(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for name, pid in list(self.pids.items()):
                try:
                    rss = memory_of(pid)["rss"]
                except (OSError, KeyError):
                    continue
                self.samples[name].append((round(time.monotonic() - self.began, 1), rss))


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `small` preset's sizes the plug-in replaces besides ffn_mult: the last stage's width (D), no dropout."""
    from shared.terms.model_config import SMALL

    return {"widths": (*SMALL.widths[:-1], args.width), "dropout": 0.0}


def write_agent_config(folder: Path, name: str, url: str, token: str, data: Path) -> Path:
    """A site agent's TOML config in `folder` (its token and store key beside it), auto-approving studies."""
    from site_agent.store import write_key_file

    folder.mkdir(parents=True, exist_ok=True)
    token_file = folder / "token"
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    write_key_file(folder / "store.key")
    lines = [
        f'name = "{name}"',
        f'coordinator_url = "{url}"',
        f'token_file = "{token_file}"',
        f'store_key_file = "{folder / "store.key"}"',
        f'store_dir = "{folder / "store"}"',
        f'cache_dir = "{folder / "cache"}"',
        'device = "cpu"',
        "auto_approve = true",
        "poll_wait_s = 5",
        "poll_interval_s = 1",
        "max_backoff_s = 10",
        "progress_bar = false",
        "",
        "[[data]]",
        'kind = "challenge"',
        f'path = "{data}"',
        f'name = "{data.name}"',
        "",
    ]
    config = folder / "site.toml"
    config.write_text("\n".join(lines))
    return config


def study_config(names: list[str], args: argparse.Namespace, secure: bool) -> dict[str, Any]:
    """One round of plain SGD (momentum 0, one step) of `bench_big` over every site; secure aggregation if asked."""
    training = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.0, "batch_size": args.batch_size, "max_steps": 1}
    privacy: dict[str, Any] = {"min_records": 1}
    if secure:
        privacy["secure_aggregation"] = {}
    return {
        "model": {"preset": PRESET},
        "training": training,
        "sites": names,
        "rounds": 1,
        "min_sites": len(names),
        "round_deadline_s": args.timeout,
        "privacy": privacy,
    }


def agents_up(admin: httpx.Client, names: list[str], agents: list[subprocess.Popen[bytes]], folder: Path) -> bool:
    """True once every agent registered its signing key (at its first poll); SystemExit when one exited."""
    for index, agent in enumerate(agents):
        if agent.poll() is not None:
            tail = (folder / f"agent-{index}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"agent {index} exited with {agent.returncode}:\n{tail}")
    sites = checked(admin.get("/api/v1/sites"))
    sites = sites["data"] if isinstance(sites, dict) else sites
    return all(site.get("signing_key") for site in sites if site["name"] in names)


def run_mode(args: argparse.Namespace, folder: Path, mode: str, data: list[Path]) -> dict[str, Any]:
    """A coordinator and SITES agents through one study in `mode`: peaks, constants, wall time, samples."""
    shutil.rmtree(folder, ignore_errors=True)  # a --workdir used before: new stores, keys and database
    folder.mkdir(parents=True)
    plugin = install_plugin(folder / "plugin", args.ffn_mult, **model_fields(args))
    env = {name: value for name, value in os.environ.items() if not name.startswith("CARDIOFL_")}
    env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))}
    env |= {"OMP_NUM_THREADS": "1", "CARDIOFL_TICK_INTERVAL_S": "1"}
    sampler = Sampler()
    coordinator, port, admin_token = start_coordinator(folder, env)
    processes: list[subprocess.Popen[bytes]] = [coordinator]
    sampler.watch("coordinator", coordinator.pid)
    url = f"http://127.0.0.1:{port}"
    agent_env = {name: value for name, value in env.items() if not name.startswith("CARDIOFL_")}
    try:
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=600.0)
        names = [f"site{index:03d}" for index in range(SITES)]
        agents = []
        for index, (name, source) in enumerate(zip(names, data, strict=True)):
            token = checked(admin.post("/api/v1/sites", json={"name": name}))["token"]["token"]
            config = write_agent_config(folder / name, name, url, token, source)
            command = [sys.executable, "-m", "cardiofl", "site", "run", "--config", str(config)]
            with (folder / f"agent-{index}.log").open("w") as log:
                agents.append(
                    subprocess.Popen(command, cwd=folder, env=agent_env, stdout=log, stderr=subprocess.STDOUT)
                )
            sampler.watch(name, agents[-1].pid)
        processes += agents
        wait_until(lambda: agents_up(admin, names, agents, folder), 300, "the agents to register")
        config = study_config(names, args, mode == "secure")
        study = checked(admin.post("/api/v1/studies", json={"name": f"big-round-{mode}", "config": config}))["id"]

        def approved() -> bool:
            agents_up(admin, names, agents, folder)
            return set(checked(admin.get(f"/api/v1/studies/{study}"))["approvals"].values()) == {"approved"}

        wait_until(approved, 300, "the agents to approve the study")
        time.sleep(2.0)  # let the agents reach their long-polls
        constants = {"coordinator": memory_of(coordinator.pid)["rss"]}
        constants |= {name: memory_of(agent.pid)["rss"] for name, agent in zip(names, agents, strict=True)}
        began = time.monotonic()
        checked(admin.post(f"/api/v1/studies/{study}/start"))

        def ended() -> bool:
            agents_up(admin, names, agents, folder)
            return checked(admin.get(f"/api/v1/studies/{study}"))["status"] in ("completed", "failed", "cancelled")

        wait_until(ended, args.timeout, f"the {mode} study to end")
        wall_s = time.monotonic() - began
        status = checked(admin.get(f"/api/v1/studies/{study}"))["status"]
        peaks = {"coordinator": memory_of(coordinator.pid)["peak"]}
        peaks |= {name: memory_of(agent.pid)["peak"] for name, agent in zip(names, agents, strict=True)}
    finally:
        sampler.close()
        stop(processes)
    if status != "completed":
        raise SystemExit(f"the {mode} study ended {status}; see {folder}")
    progress = sum(
        sum(
            1 for line in (folder / f"agent-{index}.log").read_text(errors="replace").splitlines() if " bytes (" in line
        )
        for index in range(SITES)
    )
    return {
        "wall_s": wall_s,
        "peaks": peaks,
        "constants": constants,
        "progress_lines": progress,
        "rss": sampler.samples,
    }


def judged(measured: dict[str, Any], theta: int) -> dict[str, Any]:
    """Each process's peak over its constant as a multiple of theta^g, and whether it is within its bound."""
    rows = {}
    for name, peak in measured["peaks"].items():
        bound = COORDINATOR_BOUND if name == "coordinator" else AGENT_BOUND
        ratio = (peak - measured["constants"][name]) / theta
        rows[name] = {"peak": peak, "constant": measured["constants"][name], "ratio": ratio, "bound": bound}
        rows[name]["within"] = ratio <= bound
    return rows


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Size the model, write the sites' data, and run each mode."""
    from site_agent.data.synthetic import generate_sites

    args.ffn_mult, theta = sized(args.megabytes, **model_fields(args))
    data = generate_sites(folder / "data", SITES, args.records, seed=0)
    results: dict[str, Any] = {"megabytes": args.megabytes, "theta_bytes": theta, "ffn_mult": args.ffn_mult}
    results |= {"width": args.width, "sites": SITES, "records": args.records, "batch_size": args.batch_size}
    results["modes"] = {}
    for mode in args.modes:
        measured = run_mode(args, folder / mode, mode, data)
        results["modes"][mode] = {**measured, "processes": judged(measured, theta)}
        report(mode, results["modes"][mode], theta)
    return results


def report(mode: str, measured: dict[str, Any], theta: int) -> None:
    """Print one mode's peaks, ratios and wall time."""
    print(f"{mode}: wall time {measured['wall_s']:.1f} s from the study's start to its end", flush=True)
    for name, row in measured["processes"].items():
        print(
            f"{mode}: {name} peak RSS {row['peak'] / 1e6:.0f} MB, constant {row['constant'] / 1e6:.0f} MB, "
            f"(peak - constant) / theta^g {row['ratio']:.2f} (bound {row['bound']:.0f}) "
            f"{'ok' if row['within'] else 'EXCEEDED'}",
            flush=True,
        )
    print(f"{mode}: {measured['progress_lines']} transfer progress lines in the agents' logs", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print its figures, write the JSON results; exit 1 when a bound is exceeded."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(143))  # the processes started are stopped too
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    print(f"theta^g {results['theta_bytes'] / 1e6:.1f} MB (ffn_mult {results['ffn_mult']}), {SITES} sites")
    write_results(args.out, results)
    over = [
        f"{mode} {name}"
        for mode, measured in results["modes"].items()
        for name, row in measured["processes"].items()
        if not row["within"]
    ]
    if over:
        print(f"over the memory bound: {', '.join(over)}", file=sys.stderr)
        if not args.no_bounds:
            raise SystemExit(1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
