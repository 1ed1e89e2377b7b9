"""Benchmark: complete no-training rounds through real processes, cardiofl against Flower, on 127.0.0.1.

cardiofl: `cardiofl coordinator serve` (SQLite) and K echo agents (bench/echo_agent.py, separate
processes using site_agent.client.CoordinatorClient: poll, download theta^g, upload the same tensors
with n_k). Flower (`flwr`, the `bench` extra), deployment mode: a SuperLink, K SuperNodes and the
Flower App bench/flower_echo (FedAvg; clients send back the arrays they receive), with arrays of
exactly the preset's theta^g. The first round of each run is a warm-up and is not timed.

Figures per K: seconds per round and ours / Flower's (target <= 0.06); bytes on the wire per round
(request and response bodies, counted by the agents' CoordinatorClient) against the bytes that must
move (K downloads and K uploads of theta^g; target <= 3x), all loopback bytes per round for both;
peak resident memory of the server side during the rounds (coordinator process; Flower SuperLink
tree plus its ServerApp process). Writes JSON (default bench/results/round_overhead.json).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import (
    RESULTS_DIR,
    cpu_seconds,
    descendants,
    in_workdir,
    loopback_bytes,
    memory_of,
    print_table,
    process_tree_peak,
    processes_with_env,
    write_results,
)

DEFAULT_OUT = RESULTS_DIR / "round_overhead.json"
BENCH_DIR = Path(__file__).resolve().parent
FLOWER_APP = BENCH_DIR / "flower_echo"
TARGET_TIME_RATIO = 0.06
TARGET_WIRE_RATIO = 3.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper", help="model preset whose theta^g is exchanged (default paper)")
    parser.add_argument("--sites", default="4,8", help="comma-separated K values (default 4,8)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run; the first is not timed (default 4)")
    parser.add_argument("--no-flower", action="store_true", help="run cardiofl only")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for one run")
    parser.add_argument("--workdir", type=Path, help="where databases and logs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return parser.parse_args(argv)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll `condition()` every 50 ms until it is true; SystemExit after `timeout` seconds."""
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def reset_peak_memory(pid: int) -> None:
    """Restart the VmHWM count of `pid` (Linux clear_refs), so that later readings cover only what follows."""
    with contextlib.suppress(OSError):  # a process that has just exited
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each process and whatever it started; SIGKILL what is still there after 10 s."""
    family = [pid for process in processes for pid in descendants(process.pid)]
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pid in family:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue


def stop_marked(name: str, value: str, grace_s: float = 10.0) -> None:
    """SIGTERM every process whose environment holds `name=value` until none is left; SIGKILL after `grace_s`.

    Flower's SuperNodes start SuperExec processes that start ClientApp processes; some outlive
    their parents (reparented to init), so stop() cannot find them among the descendants.
    """
    start = time.monotonic()
    while pids := processes_with_env(name, value):
        waited = time.monotonic() - start
        if waited > 3 * grace_s:
            raise SystemExit(f"processes {pids} with {name}={value} did not stop")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if waited > grace_s else signal.SIGTERM)
        time.sleep(0.2)


def preset_state(preset: str) -> bytes:
    """theta^g_0 of a one-site study of `preset`, as the coordinator stores it (safetensors)."""
    from shared.study.rules import initial_state
    from shared.tensors.codec import dump
    from shared.terms import ModelSpec, StudyTerms

    shared, _ = initial_state(StudyTerms(model=ModelSpec(preset=preset, heads="6:2"), sites=["bench"]))
    return dump(shared)


def per_round(
    arrivals: dict[int, float], counters: dict[int, float], rounds: int
) -> tuple[list[float], list[float], list[int]]:
    """(seconds, counter increase) of each round, from its first task's arrival to the next's; timed indices."""
    seconds = [arrivals[t + 1] - arrivals[t] for t in range(1, rounds + 1)]
    wire = [counters[t + 1] - counters[t] for t in range(1, rounds + 1)]
    timed = list(range(1, rounds)) if rounds > 1 else [0]  # indices: round 1 is a warm-up
    return seconds, wire, timed


def secure_phases(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """From the echo agents' timed secure tasks: per phase, the mean wall seconds and CPU seconds of one site."""
    if not tasks:
        return {}
    names = dict.fromkeys(name for task in tasks for name in task["phases"])
    return {
        "phases": {
            name: {
                key: statistics.mean(task["phases"][name][key] for task in tasks if name in task["phases"])
                for key in ("wall_s", "cpu_s")
            }
            for name in names
        }
    }


def run_ours(
    sites: int,
    args: argparse.Namespace,
    folder: Path,
    model_bytes: int,
    *,
    study_config: dict[str, Any] | None = None,
    agent_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Coordinator + `sites` echo agents as processes; rounds until the study's final evaluation round.

    `study_config` adds to (or replaces) keys of the study's config; `agent_args` go onto each agent's command line.
    """
    from coordinator.config import generate_admin_token

    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob("coordinator.db*"):  # a --workdir used before
        leftover.unlink()
    port, admin_token = free_port(), generate_admin_token()
    env = {name: value for name, value in os.environ.items() if not name.startswith("CARDIOFL_")}
    env |= {"CARDIOFL_DATABASE_URL": f"sqlite:///{folder / 'coordinator.db'}", "CARDIOFL_ADMIN_TOKEN": admin_token}
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "cardiofl", "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port)]
    processes: list[subprocess.Popen] = []
    with (folder / "coordinator.log").open("w") as log:
        coordinator = subprocess.Popen(serve, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    processes.append(coordinator)
    try:
        wait_until(lambda: _listening(port), 120, "the coordinator")
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=600)
        names = [f"site{index:03d}" for index in range(sites)]
        tokens = [_checked(admin.post("/api/v1/sites", json={"name": n}))["token"]["token"] for n in names]
        logs = [folder / f"agent-{index}.json" for index in range(sites)]
        processes += _echo_agents(folder, url, tokens, logs, agent_args)  # each registers its signing key first
        registered = lambda: all(s["signing_key"] for s in _checked(admin.get("/api/v1/sites"))["data"])  # noqa: E731
        wait_until(registered, args.timeout, "the agents to register their signing keys")
        config = {"model": {"preset": args.preset, "heads": "6:2"}, "sites": names, "rounds": args.rounds}
        config |= study_config or {}
        study = _checked(admin.post("/api/v1/studies", json={"name": "round-overhead", "config": config}))
        approvals = lambda: _checked(admin.get(f"/api/v1/studies/{study['id']}"))["approvals"]  # noqa: E731
        wait_until(lambda: set(approvals().values()) == {"approved"}, args.timeout, "the sites to approve the study")
        time.sleep(2.0)  # let the agents reach their first long-poll
        loopback_start = loopback_bytes()
        _checked(admin.post(f"/api/v1/studies/{study['id']}/start"))
        coordinator_cpu = cpu_seconds(coordinator.pid)
        start_peak = memory_of(coordinator.pid)["peak"]
        reset_peak_memory(coordinator.pid)  # round 1 (a warm-up) is under way: what follows is the rounds' memory
        agents = processes[1:]
        wait_until(lambda: all(agent.poll() is not None for agent in agents), args.timeout, "the agents to finish")
        loopback = loopback_bytes() - loopback_start
        coordinator_cpu = cpu_seconds(coordinator.pid) - coordinator_cpu
        rounds_peak = memory_of(coordinator.pid)["peak"]
        status = _checked(admin.get(f"/api/v1/studies/{study['id']}"))["status"]
    finally:
        stop(processes)
    if status != "completed" or any(agent.returncode != 0 for agent in agents):
        failed = [index for index, agent in enumerate(agents) if agent.returncode != 0]
        logs = "".join(
            f"\nagent {i} exited {agents[i].returncode}:\n{_tail(folder / f'agent-{i}.log')}" for i in failed
        )
        raise SystemExit(f"cardiofl run with K={sites} did not complete (study {status}); see {folder}{logs}")
    measured = {"loopback": loopback, "coordinator_cpu": coordinator_cpu, "peak": rounds_peak, "start_peak": start_peak}
    return _cardiofl_row(sites, args, logs, model_bytes, measured)


def _tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file (what an agent printed before it stopped)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def _echo_agents(
    folder: Path, url: str, tokens: list[str], logs: list[Path], agent_args: tuple[str, ...]
) -> list[subprocess.Popen]:
    """One echo agent process per token, each logging its tasks to its file of `logs`."""
    agents = []
    for index, (token, log_path) in enumerate(zip(tokens, logs, strict=True)):
        agent = [sys.executable, str(BENCH_DIR / "echo_agent.py"), "--url", url, "--token", token]
        agent += ["--num-examples", str(100 + index), "--log", str(log_path), *agent_args]
        with (folder / f"agent-{index}.log").open("w") as agent_log:
            agents.append(subprocess.Popen(agent, cwd=folder, stdout=agent_log, stderr=subprocess.STDOUT))
    return agents


def _cardiofl_row(
    sites: int, args: argparse.Namespace, logs: list[Path], model_bytes: int, measured: dict[str, float]
) -> dict[str, Any]:
    """A cardiofl run's row from what its agents logged per task and what was measured of its coordinator."""
    tasks = [entry for path in logs for entry in json.loads(path.read_text())]
    numbers = range(1, args.rounds + 2)  # the training rounds and the final evaluation round
    arrivals = {t: min(e["received"] for e in tasks if e["round"] == t) for t in numbers}
    counters = {t: sum(e["bytes_sent"] + e["bytes_received"] for e in tasks if e["round"] == t) for t in numbers}
    agents_cpu = {t: sum(e["cpu_s"] for e in tasks if e["round"] == t) for t in numbers}
    seconds, wire, timed = per_round(arrivals, counters, args.rounds)
    _, cpu, _ = per_round(arrivals, agents_cpu, args.rounds)
    must_move = 2 * sites * model_bytes
    return {
        "system": "cardiofl",
        "sites": sites,
        "round_s": [round(s, 3) for s in seconds],
        "s_per_round": statistics.median(seconds[i] for i in timed),
        "wire_bytes_per_round": statistics.mean(wire[i] for i in timed),
        "must_move_bytes_per_round": must_move,
        "wire_over_must_move": statistics.mean(wire[i] for i in timed) / must_move,
        "loopback_bytes_per_round": measured["loopback"] / args.rounds,  # the final evaluation moves no tensors
        "agents_cpu_s_per_round": statistics.mean(cpu[i] for i in timed),
        **secure_phases([e for e in tasks if e["round"] in {i + 1 for i in timed} and "phases" in e]),
        "coordinator_cpu_s_per_round": measured["coordinator_cpu"] / args.rounds,  # final evaluation included
        "server_peak_rss": measured["peak"],
        "server_peak_rss_with_study_start": measured["start_peak"],
    }


def _checked(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        raise SystemExit(f"{response.request.method} {response.request.url}: {response.status_code} {response.text}")
    return response.json()


def flower_missing() -> str | None:
    """Why the Flower half cannot run here, or None."""
    if importlib.util.find_spec("flwr") is None:
        return "flwr is not installed (pip install -e '.[bench]')"
    if shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None:
        return f"flower-superlink is not next to {sys.executable}"
    return None


def run_flower(
    sites: int,
    args: argparse.Namespace,
    folder: Path,
    arrays: Path,
    *,
    binaries: Path | None = None,
    run_config: str = "",
) -> dict[str, Any]:
    """A SuperLink, `sites` SuperNodes and `flwr run` of bench/flower_echo; the ServerApp times each round.

    `binaries` holds Flower's executables (default: beside this interpreter); `run_config` adds to `--run-config`.
    """
    folder.mkdir(parents=True, exist_ok=True)
    home, timings = folder / "flwr-home", folder / "timings.json"
    home.mkdir(exist_ok=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    binaries = binaries if binaries is not None else Path(sys.executable).parent
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{binaries}{os.pathsep}{os.environ.get('PATH', '')}"}
    processes: list[subprocess.Popen] = []

    def spawn(name: str, command: list[str]) -> subprocess.Popen:
        with (folder / f"{name}.log").open("w") as log:
            process = subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        processes.append(process)
        return process

    try:
        superlink = spawn(
            "superlink",
            [str(binaries / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port)]
            + ["--disable-runtime-dependency-installation"],
        )
        wait_until(lambda: _listening(port), 120, "the Flower SuperLink")
        for index in range(sites):
            spawn(
                f"supernode-{index}",
                [str(binaries / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}"]
                + ["--port", str(free_port()), "--node-config", f"partition-id={index}"],
            )
        for pid in [superlink.pid, *descendants(superlink.pid)]:
            reset_peak_memory(pid)
        loopback_start = loopback_bytes()
        settings = f'num-rounds={args.rounds} num-nodes={sites} arrays-path="{arrays}" timings-path="{timings}"'
        settings = f"{settings} {run_config}".strip()
        with (folder / "flwr-run.log").open("w") as log:
            subprocess.run(
                [str(binaries / "flwr"), "run", str(FLOWER_APP), "bench", "--run-config", settings, "--stream"],
                cwd=folder,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                check=False,
            )
        wait_until(
            timings.exists, args.timeout, "the Flower ServerApp's timings"
        )  # `flwr run` may stop streaming first
        loopback = loopback_bytes() - loopback_start
        superlink_peak = process_tree_peak(superlink.pid)
    finally:
        stop(processes)
        stop_marked("FLWR_HOME", str(home))
    return _flower_row(sites, args, json.loads(timings.read_text()), loopback, superlink_peak)


def _flower_row(
    sites: int, args: argparse.Namespace, measured: dict[str, Any], loopback: float, superlink_peak: int
) -> dict[str, Any]:
    """A Flower run's row from the ServerApp's timings and what was measured of its SuperLink."""
    seconds = [entry["end"] - entry["start"] for entry in measured["rounds"]]
    timed = seconds[1:] if len(seconds) > 1 else seconds
    return {
        "system": "flower",
        "sites": sites,
        "round_s": [round(s, 3) for s in seconds],
        "s_per_round": statistics.median(timed),
        "loopback_bytes_per_round": loopback / args.rounds,
        "server_peak_rss": superlink_peak + measured["serverapp_peak_rss"],
        "superlink_peak_rss": superlink_peak,
        "serverapp_peak_rss": measured["serverapp_peak_rss"],
        "max_abs_error": measured.get("max_abs_error", 0.0),
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """For each K: a cardiofl run, then (when flwr is here) a Flower run of the same workload."""
    state = preset_state(args.preset)
    arrays = workdir / "theta.safetensors"
    arrays.write_bytes(state)
    skipped = "--no-flower given" if args.no_flower else flower_missing()
    rows = []
    for sites in [int(k) for k in args.sites.split(",")]:
        ours = run_ours(sites, args, workdir / f"cardiofl-{sites}", len(state))
        rows.append(ours)
        if skipped is None:
            theirs = run_flower(sites, args, workdir / f"flower-{sites}", arrays)
            ours["time_over_flower"] = ours["s_per_round"] / theirs["s_per_round"]
            rows.append(theirs)
    return {
        "preset": args.preset,
        "model_bytes": len(state),
        "rounds": args.rounds,
        "flower_skipped": skipped,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table and ratios, write the JSON results."""
    args = parse_args(argv)
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    print(f"preset {results['preset']}: theta^g is {results['model_bytes'] / 1e6:.1f} MB; {args.rounds} rounds per run")
    megabytes = ("wire_bytes_per_round", "must_move_bytes_per_round", "loopback_bytes_per_round", "server_peak_rss")
    print_table(
        [{**row, **{key: row[key] / 1e6 for key in megabytes if key in row}} for row in results["rows"]],
        [
            ("system", "system"),
            ("sites", "K"),
            ("s_per_round", "s/round"),
            ("time_over_flower", "ours/Flower"),
            ("wire_bytes_per_round", "wire MB"),
            ("must_move_bytes_per_round", "must move MB"),
            ("wire_over_must_move", "wire/must"),
            ("loopback_bytes_per_round", "loopback MB"),
            ("coordinator_cpu_s_per_round", "server CPU s"),
            ("agents_cpu_s_per_round", "agents CPU s"),
            ("server_peak_rss", "server peak RSS MB"),
        ],
    )
    if results["flower_skipped"]:
        print(f"Flower half skipped: {results['flower_skipped']}")
    for row in results["rows"]:
        if row["system"] != "cardiofl":
            continue
        versus = (
            f"ratio round time ours / Flower: {row['time_over_flower']:.3f} (target <= {TARGET_TIME_RATIO})"
            if "time_over_flower" in row
            else "ratio round time ours / Flower: n/a (Flower skipped)"
        )
        print(
            f"K={row['sites']}: {versus}; ratio wire / must move: {row['wire_over_must_move']:.2f} "
            f"(target <= {TARGET_WIRE_RATIO})"
        )
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
