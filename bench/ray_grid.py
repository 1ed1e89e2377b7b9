"""Benchmark: a grid on a Ray cluster against the local backend, and a round's sites as Ray tasks against the runner.

One local Ray cluster of --cpus CPUs (default 2) is started in this process (ray.init) before anything is
timed, or the cluster at --address is joined.
grid: the same grid of a tiny experiment (the shipped `cpu` experiment's FedDualAtt at splits 8:0 and
      6:2 over --grid-runs / 2 seeds, --grid-rounds rounds) by the local backend with --jobs 2 (worker
      processes of this machine, as `experiment run --jobs 2`) and by Ray (one task a run, one CPU and
      one torch thread each, as `--backend ray`), interleaved, each into a new results file; figure:
      Ray's grid wall time over the local one's (target <= 1.10: Ray's overhead <= 10 %).
sites: one study of --sites K synthetic sites (default 4) whose local training dominates, run by the
      sequential runner and with its sites as Ray tasks (`--site-parallelism ray`), one torch thread
      per site in both (and in the driver); figure: seconds per training round after the first, in
      turn over as tasks (target >= 1.7 on 2 cores), with theta^g checked identical.
Writes JSON (default bench/results/ray_grid.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from benchlib import RESULTS_DIR, in_workdir, write_results

from cardiofl.experiment.config import ExperimentConfig, load_experiment
from cardiofl.experiment.grid import Placement, run_experiment
from cardiofl.experiment.ray_common import ray_module, torch_threads
from cardiofl.experiment.ray_sites import RaySites
from cardiofl.experiment.runner import load_sites, simulate_study
from cardiofl.experiment.site_rounds import RoundOutcome
from site_agent.device import resolve_runtime

DEFAULT_OUT = RESULTS_DIR / "ray_grid.json"
TARGET_GRID_RATIO = 1.10
TARGET_SITES_SPEEDUP = 1.7
CPU = resolve_runtime("cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster (default 2)")
    parser.add_argument("--address", help="join this Ray cluster instead of starting one (--cpus is then its own)")
    parser.add_argument("--grid-runs", type=int, default=8, help="runs of the grid, even (default 8)")
    parser.add_argument("--grid-rounds", type=int, default=3, help="rounds of each grid run (default 3)")
    parser.add_argument("--sites", type=int, default=4, help="K of the site-parallel study (default 4)")
    parser.add_argument("--site-rounds", type=int, default=4, help="rounds of that study; the first untimed")
    parser.add_argument("--records", type=int, default=240, help="records per synthetic site (default 240)")
    parser.add_argument("--repeats", type=int, default=2, help="timed pairs of each part (default 2)")
    parser.add_argument("--workdir", type=Path, help="keep the data and results here (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


def experiment(args: argparse.Namespace, folder: Path, *, sites: int, runs: int, rounds: int) -> ExperimentConfig:
    """The shipped `cpu` experiment's FedDualAtt, cut to `runs` runs of `rounds` rounds on `sites` sites."""
    shipped = load_experiment("cpu").model_dump(mode="json")
    return ExperimentConfig.model_validate(
        {
            **shipped,
            "name": f"bench-{sites}x{runs}",
            "heads": ["8:0", "6:2"] if runs > 1 else ["6:2"],
            "seeds": list(range(max(1, runs // 2))),
            "rounds": rounds,
            "methods": shipped["methods"][:1],
            "synthetic": {**shipped["synthetic"], "sites": sites, "records_per_site": args.records},
            "device": "cpu",
            "cache_dir": str(folder / "cache"),
        }
    )


def time_grid(config: ExperimentConfig, folder: Path, placement: Placement) -> float:
    """Wall seconds of the whole grid into a new results file."""
    started = time.perf_counter()
    run_experiment(config, folder / f"{uuid.uuid4().hex}.jsonl", runtime=CPU, placement=placement)
    return time.perf_counter() - started


def grid_part(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The grid by --jobs 2 and by Ray, interleaved."""
    config = experiment(args, folder, sites=3, runs=args.grid_runs, rounds=args.grid_rounds)
    load_sites(config)  # the data cache, before anything is timed
    local, on_ray = Placement(jobs=2), Placement(ray_address="local", runs_on_ray=True)
    pairs = [(time_grid(config, folder, local), time_grid(config, folder, on_ray)) for _ in range(args.repeats)]
    ratios = [ray_s / local_s for local_s, ray_s in pairs]
    return {
        "runs": len(config.runs()),
        "rounds": config.rounds,
        "local_jobs2_s": [local_s for local_s, _ in pairs],
        "ray_s": [ray_s for _, ray_s in pairs],
        "ratios": ratios,
        "ratio": statistics.median(ratios),
    }


def timed_rounds(outcomes: Iterator[RoundOutcome]) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Seconds each training round took, and theta^g after each."""
    seconds, models = [], []
    started = time.perf_counter()
    for outcome in outcomes:
        if outcome.kind == "train":
            seconds.append(time.perf_counter() - started)
            models.append(outcome.global_model)
        started = time.perf_counter()
    return seconds, models


def sites_part(args: argparse.Namespace, folder: Path, ray: Any) -> dict[str, Any]:
    """One study's rounds with its sites in turn and as Ray tasks, interleaved; rounds after the first timed."""
    config = experiment(args, folder, sites=args.sites, runs=1, rounds=args.site_rounds)
    study, data = config.study(config.runs()[0]), load_sites(config)
    tasks = RaySites(ray, config)
    in_turn: list[float] = []
    as_tasks: list[float] = []
    identical = True
    with torch_threads(1):  # a site task's threads, in the driver too
        for _ in range(args.repeats):
            alone, alone_models = timed_rounds(simulate_study(study, data, CPU, evaluate_final=False))
            parallel, parallel_models = timed_rounds(
                simulate_study(study, data, CPU, evaluate_final=False, sites=tasks)
            )
            in_turn += alone[1:]
            as_tasks += parallel[1:]
            identical &= all(
                a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
                for a, b in zip(alone_models, parallel_models, strict=True)
            )
    return {
        "sites": args.sites,
        "train_records_per_site": len(data[config.site_names()[0]].train),
        "in_turn_round_s": statistics.median(in_turn),
        "as_tasks_round_s": statistics.median(as_tasks),
        "speedup": statistics.median(in_turn) / statistics.median(as_tasks),
        "theta_identical": identical,
    }


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Start the local cluster, then measure both parts on it."""
    ray = ray_module()
    joined = ray.is_initialized()  # called from a process already connected: its cluster
    if not joined:
        cluster = {"address": args.address} if args.address else {"num_cpus": args.cpus, "include_dashboard": False}
        ray.init(**cluster, log_to_driver=False, configure_logging=False)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        return {"cpus": cpus, "grid": grid_part(args, folder), "sites": sites_part(args, folder, ray)}
    finally:
        if not joined:
            ray.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print both figures, write the JSON results."""
    args = parse_args(argv)
    if args.grid_runs < 2 or args.grid_runs % 2:
        sys.exit("--grid-runs must be even: two head splits times the seeds")
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    grid, sites = results["grid"], results["sites"]
    print(f"grid: {grid['runs']} runs of {grid['rounds']} rounds on a {results['cpus']}-CPU Ray cluster")
    print(f"  local --jobs 2: {', '.join(f'{s:.1f}' for s in grid['local_jobs2_s'])} s")
    print(f"  Ray:            {', '.join(f'{s:.1f}' for s in grid['ray_s'])} s")
    print(f"ratio Ray grid / local grid: {grid['ratio']:.3f} (target <= {TARGET_GRID_RATIO})")
    print(
        f"sites: K = {sites['sites']}, a training round in turn {sites['in_turn_round_s']:.2f} s, "
        f"as Ray tasks {sites['as_tasks_round_s']:.2f} s; theta^g identical: {sites['theta_identical']}"
    )
    print(f"speed-up sites as Ray tasks / in turn: {sites['speedup']:.2f}x (target >= {TARGET_SITES_SPEEDUP})")
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
