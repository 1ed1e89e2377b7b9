"""Benchmark: a site's local training loop against the bare forward/backward of the same model.

For each preset, a synthetic site is generated and cached (site_agent.data), then two loops run
interleaved, in the same process, from the same initial weights:
  real: site_agent.training.train_steps over cycle_batches(iterate_batches(...)) of the cache, with
        the optimizer site_agent.algorithms.base.make_optimizer builds (what run_local_round does);
  bare: forward, BCE-with-logits, backward and the same optimizer step on random tensors of the
        same shape already on the device: no data loading, no bookkeeping.
Figures: samples per second of both and the loop's overhead in % (target <= 5%). CUDA with bf16
autocast when present (site_agent.device.resolve_runtime), CPU otherwise. Writes JSON (default
bench/results/training.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from benchlib import RESULTS_DIR, in_workdir, print_table, write_results

from shared.model.network import build_model, preset
from shared.terms import TrainingConfig
from site_agent.algorithms.base import make_optimizer, steps_for
from site_agent.data import ChallengeSource, iterate_batches, open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.device import Runtime, resolve_runtime
from site_agent.training import cycle_batches, train_steps

DEFAULT_OUT = RESULTS_DIR / "training.json"
TARGET_OVERHEAD_PERCENT = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,paper", help="comma-separated model presets (default small,paper)")
    parser.add_argument("--records", type=int, default=400, help="synthetic records of the site (default 400)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, help="steps per timed run (default: one epoch; --paper-steps for paper)")
    parser.add_argument("--paper-steps", type=int, default=3, help="steps per timed run of the paper preset on CPU")
    parser.add_argument("--paper-batch-size", type=int, default=8, help="batch size of the paper preset on CPU")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed runs of each loop; median reported")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where the site's data and cache go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return parser.parse_args(argv)


def _synchronize(runtime: Runtime) -> None:
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)


def bare_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime, x, y, steps: int) -> float:
    """Seconds for `steps` forward/backward/optimizer steps on the tensors `x`, `y` (already on the device)."""
    model.train()
    _synchronize(runtime)
    start = time.perf_counter()
    for _ in range(steps):
        with runtime.autocast():
            logits = model(x)
        loss = F.binary_cross_entropy_with_logits(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    _synchronize(runtime)
    return time.perf_counter() - start


def measure(name: str, args: argparse.Namespace, site, runtime: Runtime) -> dict[str, Any]:
    """Interleaved timed runs of the real loop and the bare loop for preset `name`."""
    on_cpu = runtime.device.type == "cpu"
    batch_size = args.paper_batch_size if name == "paper" and on_cpu else args.batch_size
    training = TrainingConfig(batch_size=batch_size)
    steps = args.steps or (args.paper_steps if name == "paper" and on_cpu else steps_for(len(site.train), training, 1))
    config = preset(name, "6:2")
    real_model = build_model(config, seed=args.seed).to(runtime.device)
    bare_model = build_model(config, seed=args.seed).to(runtime.device)
    real_optimizer, bare_optimizer = make_optimizer(real_model, training), make_optimizer(bare_model, training)
    generator = torch.Generator().manual_seed(args.seed)
    batches = cycle_batches(lambda: iterate_batches(site.train, batch_size, shuffle=True, generator=generator))
    shape = next(iterate_batches(site.train, batch_size, shuffle=False))[0].shape
    x = torch.randn(batch_size, *shape[1:], generator=generator).to(runtime.device)
    y = (torch.rand(batch_size, config.n_classes, generator=generator) < 0.3).float().to(runtime.device)

    def real() -> float:
        result = train_steps(real_model, batches, real_optimizer, steps=steps, runtime=runtime)
        return steps * batch_size / result.seconds

    def bare() -> float:
        return steps * batch_size / bare_steps(bare_model, bare_optimizer, runtime, x, y, steps)

    bare(), real()  # warm-up: allocator, kernels, the cache's pages
    bare_rates, real_rates = [], []
    for _ in range(args.repeats):
        bare_rates.append(bare())
        real_rates.append(real())
    bare_rate, real_rate = statistics.median(bare_rates), statistics.median(real_rates)
    return {
        "preset": name,
        "device": runtime.describe(),
        "batch_size": batch_size,
        "steps": steps,
        "bare_samples_per_s": bare_rate,
        "loop_samples_per_s": real_rate,
        "overhead_percent": (bare_rate / real_rate - 1.0) * 100.0,
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Generate and cache the site once, then measure each preset."""
    runtime = resolve_runtime(args.device)
    folder = generate_sites(workdir / "sites", 1, args.records, args.seed, heterogeneity=0.0)[0]
    site = open_site_data(ChallengeSource(path=folder), workdir / "cache")
    rows = [measure(name, args, site, runtime) for name in args.presets.split(",")]
    return {"train_records": len(site.train), "torch_threads": torch.get_num_threads(), "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table and the overhead, write the JSON results."""
    args = parse_args(argv)
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    records, threads = results["train_records"], results["torch_threads"]
    print(f"site: {records} training records (synthetic, cached); torch threads: {threads}")
    print_table(
        results["rows"],
        [
            ("preset", "preset"),
            ("device", "device"),
            ("batch_size", "batch"),
            ("steps", "steps"),
            ("bare_samples_per_s", "bare samples/s"),
            ("loop_samples_per_s", "loop samples/s"),
            ("overhead_percent", "overhead %"),
        ],
    )
    worst = max(results["rows"], key=lambda row: row["overhead_percent"])
    print(
        f"ratio training loop overhead over bare forward/backward: {worst['overhead_percent']:.1f}% at worst "
        f"({worst['preset']}; target <= {TARGET_OVERHEAD_PERCENT:.0f}%)"
    )
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
