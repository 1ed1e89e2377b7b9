"""Soak: one coordinator through a long study of the tiny model, watched for leaks round after round.

`cardiofl coordinator serve` (SQLite, in a temporary folder) and K echo agents (bench/echo_agent.py,
separate processes speaking the real protocol: poll, download theta^g, upload an update of the same
tensors) run one study of --rounds rounds. After each settled round the coordinator process is read
from /proc: resident memory (VmRSS), open file descriptors, the descriptors open on its database
files (its SQLite connections), and the sizes of the database, its WAL and the blob directory.

After the warm-up (--warmup rounds, default the first sixth), a least-squares line through RSS
against round gives the slope, printed as `coordinator RSS slope: X MB per 100 rounds`. The served
coordinator opens its pool's connections as it starts and hands the heap an aggregation freed back
to the system after each round (coordinator.db.fill_pool, coordinator.serving.process.release_free_heap),
so neither a connection opened late nor freed heap kept shows as a slope here. The model
cache (CARDIOFL_DOWNLOAD_CACHE_BYTES) keeps recent theta^g_t up to its budget by design, so the
soak gives it a small one (--download-cache-mb) that the warm-up fills. The retention rule
(docs/hospital-it/coordinator.md) says what the disk may hold: the blob directory only the updates
of the round in progress and the spares that later uploads write over, so it stays flat; the
database keeps every theta^g_t, so it grows by about one model per round and no more.

Exits 1 when the slope is --max-slope-mb or more, when the most descriptors or database handles
open in the last quarter of the rounds exceed those of the first quarter by more than
--max-fd-growth, or when a size breaks that rule. Writes JSON (default bench/results/soak.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import MIB, RESULTS_DIR, in_workdir, memory_of, write_results
from round_overhead import free_port, preset_state, stop, wait_until

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = RESULTS_DIR / "soak.json"
# Per round the database gains one theta^g_t and rows: the round, K updates, audit events, a site's
# last contact. Measured 20-30 kB of rows per round for 4 sites; 256 kB leaves room without hiding a leak.
ROW_BYTES_PER_ROUND = 256 * 1024
# The default warm-up, a sixth of the rounds (50 of 300): the pool hands its 10 connections out in turn, and
# each prepares and keeps (up to 128) the statements of a round the first time it runs them, some 30 rounds
# for a statement run once a round; the RSS rose 12 MB over the first 50 rounds, 2 MB over the next 150.
WARMUP_SHARE = 6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="training rounds of the study (default 300)")
    parser.add_argument("--sites", type=int, default=4, help="echo agents (default 4)")
    parser.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    parser.add_argument("--warmup", type=int, help="rounds left out of the fits (default: the first sixth, at least 1)")
    parser.add_argument("--max-slope-mb", type=float, default=1.0, help="fail at an RSS slope this high, MB/100 rounds")
    parser.add_argument("--max-fd-growth", type=int, default=4, help="fail when open descriptors grow by more")
    parser.add_argument("--download-cache-mb", type=float, default=2.0, help="the coordinator's model cache, MB")
    parser.add_argument("--tick-interval", type=float, default=0.5, help="the coordinator's deadline ticker, seconds")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for the whole study")
    parser.add_argument("--workdir", type=Path, help="where the database and logs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = max(1, args.rounds // WARMUP_SHARE)
    if not 0 <= args.warmup <= args.rounds - 2:
        parser.error("--warmup must leave at least 2 rounds to fit")
    return args


def folder_bytes(path: Path) -> int:
    """Bytes the files under `path` take on disk (0 when it does not exist).

    On disk, not their lengths: a download's progress marker is a sparse file as long as the bytes sent.
    """
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_blocks * 512
            except OSError:  # removed while walking
                continue
    return total


def descriptors(pid: int, database: Path) -> tuple[int, int]:
    """(open file descriptors of `pid`, those open on `database` or its -wal/-shm files)."""
    total = on_database = 0
    for entry in os.scandir(f"/proc/{pid}/fd"):
        total += 1
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        on_database += target.startswith(str(database))
    return total, on_database


def sample(pid: int, folder: Path, round_: int, seconds: float) -> dict[str, Any]:
    """What the coordinator process holds and what its database and blob directory weigh, after `round_`."""
    database = folder / "coordinator.db"
    fds, db_handles = descriptors(pid, database)
    wal = folder / "coordinator.db-wal"
    return {
        "round": round_,
        "t_s": round(seconds, 3),
        "rss": memory_of(pid)["rss"],
        "fds": fds,
        "db_handles": db_handles,
        "db_bytes": database.stat().st_size,
        "wal_bytes": wal.stat().st_size if wal.exists() else 0,
        "blob_bytes": folder_bytes(folder / "coordinator.blobs"),
    }


def start(folder: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, str]:
    """The coordinator as a process on a free port: (process, base URL, admin token)."""
    from coordinator.config import generate_admin_token

    for leftover in folder.glob("coordinator.db*"):  # a --workdir used before
        leftover.unlink()
    port, admin_token = free_port(), generate_admin_token()
    env = {name: value for name, value in os.environ.items() if not name.startswith("CARDIOFL_")}
    env |= {
        "CARDIOFL_DATABASE_URL": f"sqlite:///{folder / 'coordinator.db'}",
        "CARDIOFL_ADMIN_TOKEN": admin_token,
        "CARDIOFL_TICK_INTERVAL_S": str(args.tick_interval),
        "CARDIOFL_DOWNLOAD_CACHE_BYTES": str(int(args.download_cache_mb * MIB)),
        "CARDIOFL_LOG_LEVEL": "WARNING",  # a line per request for weeks would be the log's growth, not the process's
    }
    serve = [sys.executable, "-m", "cardiofl", "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with (folder / "coordinator.log").open("w") as log:
        coordinator = subprocess.Popen(serve, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if coordinator.poll() is not None:
            raise SystemExit(f"the coordinator exited with {coordinator.returncode}; see {folder / 'coordinator.log'}")
        try:
            return httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, 120, "the coordinator")
    return coordinator, url, admin_token


def agents(folder: Path, url: str, tokens: list[str], rounds: int) -> list[subprocess.Popen[bytes]]:
    """One echo agent process per token; each stops after the study's final evaluation task."""
    started = []
    for index, token in enumerate(tokens):
        command = [sys.executable, str(BENCH_DIR / "echo_agent.py"), "--url", url, "--token", token]
        command += ["--num-examples", str(100 + index), "--log", str(folder / f"agent-{index}.json")]
        command += ["--tasks", str(rounds + 1)]
        with (folder / f"agent-{index}.log").open("w") as log:
            started.append(subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT))
    return started


def checked(response: httpx.Response) -> Any:
    """The JSON of an answer below 400; SystemExit naming the request otherwise."""
    if response.status_code >= 400:
        raise SystemExit(f"{response.request.method} {response.request.url}: {response.status_code} {response.text}")
    return response.json()


def running(processes: list[subprocess.Popen[bytes]], folder: Path) -> None:
    """SystemExit with the last lines of the logs when a process has failed."""
    failed = [process for process in processes if process.poll() not in (None, 0)]
    if failed:
        tails = "".join(
            f"\n{log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            for log in sorted(folder.glob("*.log"))
            if log.stat().st_size
        )
        raise SystemExit(f"{len(failed)} process(es) exited early (first: {failed[0].returncode}){tails}")


def soak(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """Run the study, sampling the coordinator after every settled round; the samples (round 0: at the start)."""
    folder.mkdir(parents=True, exist_ok=True)
    coordinator, url, admin_token = start(folder, args)
    processes = [coordinator]
    try:
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=120)
        names = [f"site{index:03d}" for index in range(args.sites)]
        tokens = [checked(admin.post("/api/v1/sites", json={"name": name}))["token"]["token"] for name in names]
        config = {
            "model": {"preset": args.preset, "heads": "6:2"},
            "sites": names,
            "rounds": args.rounds,
            "min_sites": args.sites,
            "round_deadline_s": args.timeout,
        }
        study = checked(admin.post("/api/v1/studies", json={"name": "soak", "config": config}))["id"]
        processes += agents(folder, url, tokens, args.rounds)

        def approved() -> bool:
            running(processes, folder)
            return set(checked(admin.get(f"/api/v1/studies/{study}"))["approvals"].values()) == {"approved"}

        wait_until(approved, 300, "the agents to approve the study")
        checked(admin.post(f"/api/v1/studies/{study}/start"))
        began = time.monotonic()
        samples = [sample(coordinator.pid, folder, 0, 0.0)]
        status = "running"
        while status == "running":
            if time.monotonic() - began > args.timeout:
                raise SystemExit(f"the study did not finish within {args.timeout:.0f} s; see {folder}")
            running(processes, folder)
            view = checked(admin.get(f"/api/v1/studies/{study}"))
            status, done = view["status"], view["completed_rounds"]
            if done > samples[-1]["round"]:
                samples.append(sample(coordinator.pid, folder, done, time.monotonic() - began))
            else:
                time.sleep(0.1)
        if status != "completed":
            raise SystemExit(f"the study ended {status}; see {folder}")
        admin.close()
    finally:
        stop(processes)
    return samples


def slope(samples: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope of `key` against round, per round."""
    rounds = [float(entry["round"]) for entry in samples]
    values = [float(entry[key]) for entry in samples]
    return statistics.linear_regression(rounds, values).slope


def judge(samples: list[dict[str, Any]], args: argparse.Namespace, model_bytes: int) -> dict[str, Any]:
    """The figures of the run after its warm-up, and the checks they fail (an empty list: none)."""
    start = args.warmup
    after = [entry for entry in samples if entry["round"] >= start]
    first, last = after[0], after[-1]
    rss_slope_mb = slope(after, "rss") * 100 / MIB
    db_per_round = slope(after, "db_bytes")
    blob_cap = 3 * args.sites * model_bytes + MIB  # the round in progress, as many spares, and slack
    seconds = last["t_s"] - first["t_s"]
    figures = {
        "fitted_from_round": start,
        "rss_slope_mb_per_100_rounds": rss_slope_mb,
        "rss_first_mb": first["rss"] / MIB,
        "rss_last_mb": last["rss"] / MIB,
        "rss_peak_mb": max(entry["rss"] for entry in samples) / MIB,
        "fds_first": first["fds"],
        "fds_last": last["fds"],
        "fds_max": max(entry["fds"] for entry in after),
        "db_handles_first": first["db_handles"],
        "db_handles_last": last["db_handles"],
        "db_handles_max": max(entry["db_handles"] for entry in after),
        "db_bytes_first": first["db_bytes"],
        "db_bytes_last": last["db_bytes"],
        "db_bytes_per_round": db_per_round,
        "db_allowed_bytes_per_round": model_bytes + ROW_BYTES_PER_ROUND,
        "wal_bytes_max": max(entry["wal_bytes"] for entry in after),
        "blob_bytes_max": max(entry["blob_bytes"] for entry in after),
        "blob_bytes_last": last["blob_bytes"],
        "blob_allowed_bytes": blob_cap,
        "rounds_per_s": (last["round"] - first["round"]) / seconds if seconds > 0 else None,
        "s_per_100_rounds": 100 * seconds / (last["round"] - first["round"]),
    }
    failures = []
    if rss_slope_mb >= args.max_slope_mb:
        failures.append(f"RSS slope {rss_slope_mb:.2f} MB per 100 rounds >= {args.max_slope_mb}")
    quarter = max(1, len(after) // 4)  # sockets come and go within a round: compare the most in each window
    for key, what in (("fds", "open descriptors"), ("db_handles", "database handles")):
        early, late = (max(entry[key] for entry in window) for window in (after[:quarter], after[-quarter:]))
        if late - early > args.max_fd_growth:
            failures.append(f"{what} grew: at most {early} in the first quarter after the warm-up, {late} in the last")
    if db_per_round > figures["db_allowed_bytes_per_round"]:
        failures.append(f"the database grew {db_per_round / 1024:.0f} kB per round, more than one model and its rows")
    if figures["blob_bytes_max"] > blob_cap:
        most = figures["blob_bytes_max"] / MIB
        failures.append(f"the blob directory reached {most:.1f} MB, over {blob_cap / MIB:.1f}")
    return {"figures": figures, "failures": failures}


def report(results: dict[str, Any]) -> None:
    """The lines a reader (and CI's log) looks for."""
    figures, rounds = results["figures"], results["rounds"]
    warmup = f"warm-up {results['warmup']}, fitted from round {figures['fitted_from_round']}"
    print(f"soak: {rounds} rounds of {results['preset']} with {results['sites']} agents, {warmup}")
    print(f"coordinator RSS slope: {figures['rss_slope_mb_per_100_rounds']:.3f} MB per 100 rounds")
    print(f"coordinator RSS: first {figures['rss_first_mb']:.1f} MB, last {figures['rss_last_mb']:.1f} MB")
    print(f"open fds: first {figures['fds_first']}, last {figures['fds_last']}, most {figures['fds_max']}")
    print(f"database handles: first {figures['db_handles_first']}, last {figures['db_handles_last']}")
    print(
        f"database size: first {figures['db_bytes_first'] / MIB:.2f} MB, last {figures['db_bytes_last'] / MIB:.2f} MB, "
        f"{figures['db_bytes_per_round'] / 1024:.1f} kB per round "
        f"(allowed {figures['db_allowed_bytes_per_round'] / 1024:.1f}: one theta^g_t and its rows)"
    )
    print(
        f"blob directory: most {figures['blob_bytes_max'] / 1024:.1f} kB, "
        f"last {figures['blob_bytes_last'] / 1024:.1f} kB "
        f"(allowed {figures['blob_allowed_bytes'] / 1024:.1f} kB: the round in progress and spares)"
    )
    print(f"write-ahead log: most {figures['wal_bytes_max'] / MIB:.1f} MB (copied back every 0.5 s)")
    print(f"pace: {figures['s_per_100_rounds']:.1f} s per 100 rounds")
    for failure in results["failures"]:
        print(f"FAILED: {failure}")


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print its lines, write the JSON; 1 when a check failed."""
    args = parse_args(argv)
    model_bytes = len(preset_state(args.preset))
    samples = in_workdir(args.workdir, lambda folder: soak(args, folder))
    verdict = judge(samples, args, model_bytes)
    results = {
        "preset": args.preset,
        "sites": args.sites,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "model_bytes": model_bytes,
        "max_slope_mb": args.max_slope_mb,
        **verdict,
        "samples": samples,
    }
    report(results)
    write_results(args.out, results)
    return 1 if verdict["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
