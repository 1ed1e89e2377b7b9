"""Benchmark: what one coordinator costs per site as the number of sites K grows (8, 32, 128 by default).

K simulated sites speak the real protocol from one asyncio process (128 torch agents do not fit
in one machine's memory): each registers its signing key, approves the study it is offered with
the digest of its terms (as `auto_approve` does), long-polls for tasks, downloads theta^g
(checking its sha256) and uploads the same tensors with its n_k; the final evaluation round uploads
statistics only. The coordinator is `cardiofl coordinator serve` as a process, on SQLite (one
worker) and on PostgreSQL (`--workers`, 2 by default), both by default; with --mutual-tls it
serves HTTPS from a CA made for the run (`cardiofl coordinator tls init`), and every site and the
status probe present one client certificate it issued (`tls client`), a fresh handshake per request.

Per database and K, per timed round (from the first task of round t to the first of round t+1;
round 1 is a warm-up): wall seconds, the coordinator's CPU seconds per site (its process and its
workers), p50/p99 seconds of the sites' polls (time to a task, long-poll waits included, so only
their tail says much), downloads and uploads (as the sites' one event loop sees them, its own lag
included), errors (HTTP >= 400 other than the protocol's own answers, and dropped connections),
the p99 of an admin's GET /api/v1/status issued once a second by a process of its own
(bench/status_probe.py) while the sites poll (target < 1 s), and on PostgreSQL the table reads and row writes per site
(pg_stat_user_tables: scans + rows inserted, updated, deleted), a count that grows faster than K
if some query or loop does.

The last line is `per-site CPU growth: <ratio>x`: the coordinator's CPU per site at the largest K
over that at the smallest, the worse of the databases (target <= 1.5). Writes JSON (default
bench/results/scale.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from benchlib import RESULTS_DIR, cpu_seconds, descendants, in_workdir, print_table, write_results
from scale_sites import Recorder, Site, percentile

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", default="8,32,128", help="comma-separated K values")
    parser.add_argument("--databases", default="sqlite,postgresql", help="sqlite, postgresql or both")
    parser.add_argument("--postgres-url", default=os.environ.get("CARDIOFL_TEST_POSTGRES_URL", DEFAULT_POSTGRES))
    parser.add_argument("--workers", type=int, default=2, help="uvicorn workers on PostgreSQL")
    parser.add_argument("--preset", default="small", help="model preset (tiny, small, paper)")
    parser.add_argument("--rounds", type=int, default=3, help="training rounds (the first is a warm-up)")
    parser.add_argument("--poll-wait", type=float, default=5.0, help="the sites' long-poll wait, seconds")
    parser.add_argument("--poll-interval", type=float, default=5.0, help="an agent's pause after an empty answer")
    parser.add_argument(
        "--mutual-tls", action="store_true", help="HTTPS with client certificates (the coordinator's CA)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one run")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "scale.json")
    return parser.parse_args(argv)


def tls_context(tls: list[str]) -> ssl.SSLContext | bool:
    """The client side of mutual TLS from (CA, client certificate, key) files; True (the defaults) without them."""
    if not tls:
        return True
    context = ssl.create_default_context(cafile=tls[0])
    context.load_cert_chain(tls[1], tls[2])
    return context


def mutual_tls(folder: Path, env: dict[str, str]) -> tuple[list[str], list[str]]:
    """A CA, a certificate for 127.0.0.1 and a client certificate in `folder`: (serve options, client files)."""
    cardiofl = [sys.executable, "-m", "cardiofl", "coordinator", "tls"]
    tls_dir, client = folder / "tls", folder / "client"
    for made in (tls_dir, client):
        if made.exists():  # a --workdir used before
            shutil.rmtree(made)
    with (folder / "tls.log").open("w") as log:
        for command in (["init", "--host", "127.0.0.1"], ["client", "bench", "--out", str(client)]):
            run = [*cardiofl, *command, "--dir", str(tls_dir)]
            subprocess.run(run, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    files = [str(tls_dir / "ca.pem"), str(client / "client.pem"), str(client / "client.key")]
    return ["--tls-dir", str(tls_dir), "--mutual-tls"], files


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (the coordinator and its uvicorn workers)."""
    total = 0.0
    for member in [pid, *descendants(pid)]:
        try:
            total += cpu_seconds(member)
        except (OSError, IndexError):
            continue
    return total


def postgres_counts(url: str, schema: str) -> int:
    """Table reads and row writes in `schema` so far (pg_stat_user_tables), as PostgreSQL counts them."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return int(
                connection.scalar(
                    text(
                        "SELECT coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0) + n_tup_ins + n_tup_upd "
                        "+ n_tup_del), 0) FROM pg_stat_user_tables WHERE schemaname = :schema"
                    ),
                    {"schema": schema},
                )
            )
    finally:
        engine.dispose()


@contextmanager
def postgres_schema(url: str) -> Iterator[tuple[str, str]]:
    """(a URL whose connections use a fresh schema, the schema's name); dropped afterwards."""
    from sqlalchemy import create_engine, text

    schema = f"scale_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    separator = "&" if "?" in url else "?"
    try:
        yield f"{url}{separator}options=-csearch_path%3D{schema}", schema
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


async def drive(
    url: str, admin_token: str, sites: int, args: argparse.Namespace, coordinator: int, tls: list[str], **db: str
) -> dict:
    """Enrol `sites` sites, run one study through them, and measure it; the run's row.

    `tls`: none, or the CA, client certificate and key files that every client presents under mutual TLS.
    """
    recorder = Recorder()
    verify = tls_context(tls)
    headers = {"Authorization": f"Bearer {admin_token}"}
    admin = httpx.AsyncClient(base_url=url, headers=headers, timeout=120.0, verify=verify)
    names = [f"site{index:03d}" for index in range(sites)]
    tokens = []
    for name in names:
        response = await admin.post("/api/v1/sites", json={"name": name})
        response.raise_for_status()
        tokens.append(response.json()["token"]["token"])
    config = {
        "model": {"preset": args.preset, "heads": "6:2"},
        "sites": names,
        "rounds": args.rounds,
        "min_sites": sites,
        "round_deadline_s": args.timeout,
    }
    created = await admin.post("/api/v1/studies", json={"name": f"scale-{sites}", "config": config})
    created.raise_for_status()
    study_id = created.json()["id"]
    members = [
        Site(url, name, token, 100 + index, args.poll_wait, args.poll_interval, verify)
        for index, (name, token) in enumerate(zip(names, tokens, strict=True))
    ]

    def on_round(number: int) -> None:
        if number not in recorder.round_started:
            recorder.round_started[number] = time.perf_counter()
            marks = {"cpu": tree_cpu(coordinator)}
            if db.get("schema"):
                marks["rows"] = postgres_counts(db["base_url"], db["schema"])
            recorder.marks[number] = marks

    deadline = time.perf_counter() + args.timeout
    tasks = [asyncio.create_task(member.run(recorder, on_round)) for member in members]
    prober: subprocess.Popen | None = None
    status_latency: list[float] = []
    first = ""
    try:
        if not await approved(admin, study_id, recorder, deadline):
            return incomplete(recorder, sites, "the sites' approvals", tasks)
        prober = start_probe(url, admin_token, tls)
        assert prober.stdout is not None
        first = await asyncio.to_thread(prober.stdout.readline)  # it answers once (the sites polling) before the start
        (await admin.post(f"/api/v1/studies/{study_id}/start")).raise_for_status()
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.perf_counter()))
        if pending:
            return incomplete(recorder, sites, f"{len(pending)} of {sites} sites to finish", tasks)
    finally:
        if prober is not None:
            status_latency = stop_probe(prober, recorder, first)
        end = {"cpu": tree_cpu(coordinator)}
        if db.get("schema"):
            end["rows"] = postgres_counts(db["base_url"], db["schema"])
        for member in members:
            await member.http.aclose()
        await admin.aclose()
    recorder.round_started[args.rounds + 2] = time.perf_counter()
    recorder.marks[args.rounds + 2] = end
    return summarise(recorder, sites, args.rounds, status_latency)


def start_probe(url: str, admin_token: str, tls: list[str]) -> subprocess.Popen:
    """bench/status_probe.py as a process of its own: GET /status once a second, off the sites' busy event loop."""
    env = {**os.environ, "CARDIOFL_ADMIN_TOKEN": admin_token}
    command = [sys.executable, str(Path(__file__).with_name("status_probe.py")), url, *tls]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)


def stop_probe(prober: subprocess.Popen, recorder: Recorder, first: str) -> list[float]:
    """Stop the probe; its latencies, `first` (its line before the study) included; an error line goes to the errors."""
    prober.terminate()
    output, _ = prober.communicate(timeout=30)
    latencies = []
    for line in [first, *output.splitlines()]:
        if line.startswith("error "):
            recorder.errors.append(line.removeprefix("error "))
        elif line.strip():
            latencies.append(float(line))
    return latencies


async def approved(admin: httpx.AsyncClient, study_id: int, recorder: Recorder, deadline: float) -> bool:
    """Wait until every site approved the study (True), or until `deadline` (False)."""
    while time.perf_counter() < deadline:
        try:
            response = await admin.get(f"/api/v1/studies/{study_id}")
        except httpx.TransportError as exc:
            recorder.errors.append(f"admin study: dropped: {type(exc).__name__}")
        else:
            if response.status_code != 200:
                recorder.errors.append(f"admin study: {response.status_code} {response.text[:200]}")
            elif set(response.json()["approvals"].values()) == {"approved"}:
                return True
        await asyncio.sleep(1.0)
    return False


def incomplete(recorder: Recorder, sites: int, what: str, tasks: list[asyncio.Task]) -> dict[str, Any]:
    """The row of a run that did not finish within --timeout: what it waited for, and its errors."""
    for task in tasks:
        task.cancel()
    return {
        "sites": sites,
        "completed": False,
        "waiting_for": what,
        "errors": len(recorder.errors),
        "error_examples": recorder.errors[:5],
    }


def summarise(recorder: Recorder, sites: int, rounds: int, status_latency: list[float]) -> dict[str, Any]:
    """The timed rounds (2 .. T) of a run, as one row."""
    timed = range(2, rounds + 1) if rounds > 1 else range(1, 2)
    starts, marks = recorder.round_started, recorder.marks
    wall = [starts[t + 1] - starts[t] for t in timed]
    cpu = [(marks[t + 1]["cpu"] - marks[t]["cpu"]) / sites for t in timed]
    row: dict[str, Any] = {
        "sites": sites,
        "completed": True,
        "round_s": [round(s, 3) for s in wall],
        "s_per_round": statistics.median(wall),
        "cpu_s_per_site": statistics.median(cpu),
        "errors": len(recorder.errors),
        "error_examples": recorder.errors[:5],
        "status_p99_s": percentile(status_latency, 99),
    }
    for kind in ("poll", "download", "upload"):
        values = [v for t in timed for v in recorder.latencies.get((t, kind), [])]
        row[f"{kind}_p50_s"], row[f"{kind}_p99_s"] = percentile(values, 50), percentile(values, 99)
    if all("rows" in marks[t] for t in [*timed, timed[-1] + 1]):
        row["db_rows_per_site"] = statistics.median((marks[t + 1]["rows"] - marks[t]["rows"]) / sites for t in timed)
    return row


def run_one(database: str, sites: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """A coordinator on `database` and `sites` simulated sites: one study of args.rounds rounds."""
    from coordinator.config import generate_admin_token

    folder = workdir / f"{database}-{sites}"
    folder.mkdir(parents=True, exist_ok=True)
    admin_token = generate_admin_token()
    env = {name: value for name, value in os.environ.items() if not name.startswith("CARDIOFL_")}
    env |= {
        "CARDIOFL_ADMIN_TOKEN": admin_token,
        "CARDIOFL_TICK_INTERVAL_S": "1",
        "CARDIOFL_MAX_POLL_WAIT_S": str(args.poll_wait),
    }
    with _database(database, args, folder) as (database_url, schema):
        env["CARDIOFL_DATABASE_URL"] = database_url
        port = _free_port()
        serve = [sys.executable, "-m", "cardiofl", "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port)]
        if database == "postgresql":
            migrate = [sys.executable, "-m", "cardiofl", "coordinator", "migrate"]
            with (folder / "migrate.log").open("w") as log:
                subprocess.run(migrate, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
            env["CARDIOFL_MIGRATE_ON_START"] = "false"
            serve += ["--workers", str(args.workers)]
        tls: list[str] = []
        if args.mutual_tls:
            options, tls = mutual_tls(folder, env)
            serve += options
        with (folder / "coordinator.log").open("w") as log:
            coordinator = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
            _wait_healthy(url, coordinator, tls_context(tls))
            db = {"schema": schema, "base_url": args.postgres_url} if schema else {}
            row = asyncio.run(drive(url, admin_token, sites, args, coordinator.pid, tls, **db))
        finally:
            coordinator.terminate()
            try:
                coordinator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                coordinator.kill()
                coordinator.wait()
    workers = args.workers if database == "postgresql" else 1
    return {"database": database, "workers": workers, "mutual_tls": args.mutual_tls, **row}


@contextmanager
def _database(database: str, args: argparse.Namespace, folder: Path) -> Iterator[tuple[str, str | None]]:
    if database == "sqlite":
        for leftover in folder.glob("coordinator.db*"):
            leftover.unlink()
        yield f"sqlite:///{folder / 'coordinator.db'}", None
        return
    with postgres_schema(args.postgres_url) as (url, schema):
        yield url, schema


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, verify: ssl.SSLContext | bool, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the coordinator exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the coordinator did not answer within {timeout:.0f} s")


def growth(rows: list[dict[str, Any]]) -> float | None:
    """The coordinator's CPU per site at the largest K over the smallest, the worse of the databases."""
    ratios = []
    for database in {row["database"] for row in rows}:
        mine = sorted((row for row in rows if row["database"] == database), key=lambda row: row["sites"])
        if any(not row.get("completed", True) for row in mine):
            return float("inf")  # a K that did not finish: no growth to speak of
        if len(mine) > 1 and mine[0]["cpu_s_per_site"] > 0:
            ratios.append(mine[-1]["cpu_s_per_site"] / mine[0]["cpu_s_per_site"])
    return max(ratios) if ratios else None


def main(argv: list[str] | None = None) -> None:
    """Every database x K, then the table and the growth line."""
    args = parse_args(argv)
    databases = [name.strip() for name in args.databases.split(",") if name.strip()]
    unknown = set(databases) - {"sqlite", "postgresql"}
    if unknown:
        raise SystemExit(f"unknown databases {sorted(unknown)}; choose sqlite, postgresql or both")
    sizes = [int(k) for k in args.sites.split(",")]

    def run(workdir: Path) -> list[dict[str, Any]]:
        rows = []
        for database in databases:
            for sites in sizes:
                print(f"{database} K={sites} ...", flush=True)
                rows.append(run_one(database, sites, args, workdir))
        return rows

    rows = in_workdir(args.workdir, run)
    columns = [
        ("database", "database"),
        ("sites", "K"),
        ("s_per_round", "s/round"),
        ("cpu_s_per_site", "coord. CPU s/site"),
        ("poll_p50_s", "poll p50"),
        ("poll_p99_s", "poll p99"),
        ("download_p50_s", "download p50"),
        ("download_p99_s", "download p99"),
        ("upload_p50_s", "upload p50"),
        ("upload_p99_s", "upload p99"),
        ("status_p99_s", "status p99"),
        ("db_rows_per_site", "DB reads+writes/site"),
        ("errors", "errors"),
    ]
    print_table(rows, columns)
    for row in rows:
        if not row.get("completed", True):
            waited = row["waiting_for"]
            print(f"{row['database']} K={row['sites']}: did not finish within --timeout, waiting for {waited}")
        for example in row["error_examples"]:
            print(f"{row['database']} K={row['sites']}: {example}")
    write_results(args.out, {"preset": args.preset, "rounds": args.rounds, "poll_wait_s": args.poll_wait, "rows": rows})
    ratio = growth(rows)
    print(f"per-site CPU growth: {'n/a' if ratio is None else f'{ratio:.2f}'}x")  # inf: a K did not finish


if __name__ == "__main__":
    main(sys.argv[1:])
