"""Benchmark: the coordinator's aggregation of K stored updates against the machine's memory-copy bandwidth.

For each preset and K, one subprocess fills a fresh, migrated coordinator database (a SQLite file, or with
`--database` a schema of its own in PostgreSQL, whose server memory is not counted) through
the coordinator's own functions: K sites, a started study, and K accepted updates of theta^g, kept
in the coordinator's blob store (files; `--updates-in database` keeps them in the database). A
second, fresh subprocess then (a) reads and sums the K stored updates the way the round engine
does (coordinator.storage.stored_updates.add_stored_updates into a shared.algorithms.aggregation.WeightedAverage),
`--repeats` times, timing the reading and the final division (`result`) apart, and (b) runs the
round engine's whole `aggregate_round` once (claim, average, store theta^g_t, open the next round).
Figures: bytes of updates read per second / numpy copy bandwidth measured in this run (target >=
0.5; best pass, median pass, and the cold first pass of the process), and that process's peak
resident memory against the model size (target: independent of K). Writes JSON (default
bench/results/aggregation.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchlib import (
    MIB,
    RESULTS_DIR,
    copy_bandwidth,
    echo_update,
    in_workdir,
    memory_of,
    print_table,
    write_results,
)

DEFAULT_OUT = RESULTS_DIR / "aggregation.json"
TARGET_RATIO = 0.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,paper", help="comma-separated model presets (default small,paper)")
    parser.add_argument("--sites", default="4,16,64", help="comma-separated K values (default 4,16,64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over the K updates; the best reported")
    parser.add_argument("--copy-mib", type=int, default=512, help="buffer size of the copy baseline in MiB")
    parser.add_argument(
        "--database",
        default="sqlite",
        help="sqlite (default: a file per K in --workdir) or a PostgreSQL URL (postgresql+psycopg://...): "
        "a schema of its own per K, dropped after",
    )
    parser.add_argument(
        "--updates-in",
        choices=["store", "database"],
        default="store",
        help="where accepted updates are kept: the blob store (default, a folder per K in --workdir) or the database",
    )
    parser.add_argument("--workdir", type=Path, help="where the databases go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--role", choices=["setup", "measure"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--blob-dir", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _sessions(url: str, blob_dir: Path | None) -> tuple[Any, Any, Any]:
    """(engine, sessionmaker, blob store or None) as the coordinator builds them."""
    from coordinator.db import make_engine, make_sessionmaker
    from coordinator.storage.update_files import FileBlobStore

    engine = make_engine(url)
    store = FileBlobStore(blob_dir) if blob_dir is not None else None
    return engine, make_sessionmaker(engine, store), store


def setup(url: str, preset: str, sites: int, blob_dir: Path | None) -> dict[str, Any]:
    """A migrated coordinator database holding one open round with an accepted update from each of `sites` sites."""
    from benchlib import start_bench_study

    from coordinator.db import utc_now
    from coordinator.migrate import upgrade_database
    from coordinator.models import GlobalModel, Role
    from coordinator.rounds.updates import accept_update
    from coordinator.sites.security import Principal
    from coordinator.storage.blobs import read_blob

    engine, sessions, _ = _sessions(url, blob_dir)
    upgrade_database(engine)
    study = start_bench_study(sessions, preset=preset, sites=sites, rounds=2)
    with sessions() as session:
        digest = session.query(GlobalModel.sha256).filter(GlobalModel.study_id == study["study_id"]).scalar()
        global_model = read_blob(session, digest)
    for index, site in enumerate(study["sites"]):
        body = echo_update(global_model, num_examples=100 + index)  # n_k differ, so the K blobs differ
        caller = Principal(Role.SITE, f"site:{site['name']}", site["token_id"], site["site_id"], site["name"])
        with sessions() as session:
            accept_update(
                session, round_id=study["round_id"], site=caller, body=body, max_num_examples=10**6, now=utc_now()
            )
    engine.dispose()
    return {"round_id": study["round_id"], "model_bytes": len(global_model)}


def measure(url: str, repeats: int, blob_dir: Path | None) -> dict[str, Any]:
    """Time the read-and-average pass over the stored updates, then one whole aggregate_round; memory readings."""
    from sqlalchemy import select

    from coordinator.db import utc_now
    from coordinator.models import Blob, Round, RoundStatus, Update
    from coordinator.rounds.closing import aggregate_round
    from coordinator.serving.process import configure_server_process, freeze_startup_objects
    from coordinator.storage.stored_updates import add_stored_updates
    from shared.algorithms.aggregation import WeightedAverage

    configure_server_process()  # as `cardiofl coordinator serve` runs
    engine, sessions, store = _sessions(url, blob_dir)
    with sessions() as session:
        round_id = session.scalar(select(Round.id).where(Round.status == RoundStatus.OPEN))
        stored = session.execute(
            select(Update.sha256, Update.num_examples, Blob.size)
            .join(Blob, Blob.sha256 == Update.sha256)
            .where(Update.round_id == round_id)
        ).all()
    total = sum(n for _, n, _ in stored)
    freeze_startup_objects()  # as the server does once started
    baseline = memory_of()["rss"]

    reads, results = [], []
    for _ in range(repeats):  # the first pass is cold: fresh connections, fresh buffers for the sums
        average = WeightedAverage()
        start = time.perf_counter()
        digests, weights = [digest for digest, _, _ in stored], [n / total for _, n, _ in stored]
        add_stored_updates(average, engine, digests, weights, store=store)
        reads.append(time.perf_counter() - start)
        average.result()
        results.append(time.perf_counter() - start - reads[-1])
        del average  # its buffers serve the next pass, as one round's serve the next in a coordinator
    start = time.perf_counter()
    completed = aggregate_round(sessions, round_id, now=utc_now(), lease_s=600.0)
    round_s = time.perf_counter() - start
    if not completed:
        raise SystemExit("aggregate_round did not complete the round")
    return {
        "updates_bytes": sum(size for _, _, size in stored),
        "read_s": min(reads),  # the best pass: the machine is shared, interference only adds time
        "read_s_median": statistics.median(reads),
        "read_s_cold": reads[0],
        "result_s": min(results),
        "aggregate_round_s": round_s,
        "rss_baseline": baseline,
        "rss_peak": memory_of()["peak"],
    }


def _worker(role: str, url: str, extra: list[str]) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--url", url, *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{role} worker failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def _fresh_database(database: str, workdir: Path, name: str) -> Iterator[str]:
    """The URL of an empty database: a SQLite file in `workdir`, or a new schema of PostgreSQL `database`."""
    if database == "sqlite":
        try:
            yield f"sqlite:///{workdir / name}.db"
        finally:
            for leftover in workdir.glob(f"{name}.db*"):
                leftover.unlink()
            shutil.rmtree(workdir / f"{name}.blobs", ignore_errors=True)
        return
    from sqlalchemy import create_engine, text

    schema = f"bench_aggregation_{name}"
    admin = create_engine(database)
    try:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield f"{database}{'&' if '?' in database else '?'}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Copy baseline, then for every (preset, K) a setup and a measuring subprocess on a fresh database."""
    bandwidth = copy_bandwidth(args.copy_mib * MIB)
    rows = []
    for preset in args.presets.split(","):
        for sites in [int(k) for k in args.sites.split(",")]:
            name = f"{preset}_{sites}"
            blob_dir = ["--blob-dir", str(workdir / f"{name}.blobs")] if args.updates_in == "store" else []
            with _fresh_database(args.database, workdir, name) as url:
                prepared = _worker("setup", url, ["--presets", preset, "--sites", str(sites), *blob_dir])
                measured = _worker("measure", url, ["--repeats", str(args.repeats), *blob_dir])
            shutil.rmtree(workdir / f"{name}.blobs", ignore_errors=True)
            model = prepared["model_bytes"]
            read_rate = measured["updates_bytes"] / measured["read_s"]
            rows.append(
                {
                    "preset": preset,
                    "sites": sites,
                    "model_mb": model / 1e6,
                    "read_s": measured["read_s"],
                    "read_gb_s": read_rate / 1e9,
                    "ratio_to_copy": read_rate / bandwidth,
                    "median_ratio_to_copy": measured["updates_bytes"] / measured["read_s_median"] / bandwidth,
                    "cold_ratio_to_copy": measured["updates_bytes"] / measured["read_s_cold"] / bandwidth,
                    "result_s": measured["result_s"],
                    "aggregate_round_s": measured["aggregate_round_s"],
                    "round_ratio_to_copy": measured["updates_bytes"] / measured["aggregate_round_s"] / bandwidth,
                    "rss_baseline_mb": measured["rss_baseline"] / 1e6,
                    "rss_peak_mb": measured["rss_peak"] / 1e6,
                    "peak_over_baseline_models": (measured["rss_peak"] - measured["rss_baseline"]) / model,
                }
            )
    database = "sqlite" if args.database == "sqlite" else "postgresql"
    return {
        "copy_gb_s": bandwidth / 1e9,
        "target_ratio": TARGET_RATIO,
        "database": database,
        "updates_in": args.updates_in,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (or one of its workers), print the table and ratios, write the JSON results."""
    args = parse_args(argv)
    if args.role == "setup":
        print(json.dumps(setup(args.url, args.presets, int(args.sites), args.blob_dir)))
        return {}
    if args.role == "measure":
        print(json.dumps(measure(args.url, args.repeats, args.blob_dir)))
        return {}
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    copy = f"memory copy (numpy, {args.copy_mib} MiB): {results['copy_gb_s']:.2f} GB/s"
    print(f"database: {results['database']}; updates in: {results['updates_in']}; {copy}")

    print_table(
        results["rows"],
        [
            ("preset", "preset"),
            ("sites", "K"),
            ("model_mb", "model MB"),
            ("read_gb_s", "read GB/s"),
            ("ratio_to_copy", "/copy"),
            ("median_ratio_to_copy", "median"),
            ("cold_ratio_to_copy", "cold"),
            ("result_s", "result s"),
            ("aggregate_round_s", "round s"),
            ("round_ratio_to_copy", "round /copy"),
            ("rss_baseline_mb", "RSS base MB"),
            ("rss_peak_mb", "RSS peak MB"),
            ("peak_over_baseline_models", "(peak-base)/model"),
        ],
    )
    worst = min(results["rows"], key=lambda row: row["ratio_to_copy"])
    print(
        f"ratio aggregation read / memory copy: {worst['ratio_to_copy']:.2f}x at worst "
        f"({worst['preset']}, K={worst['sites']}; target >= {TARGET_RATIO})"
    )
    for preset in dict.fromkeys(row["preset"] for row in results["rows"]):
        peaks = [row["peak_over_baseline_models"] for row in results["rows"] if row["preset"] == preset]
        print(f"peak memory above baseline, {preset}: {min(peaks):.2f} to {max(peaks):.2f} models over K")
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
