"""Benchmark: the site agent's training on a GPU: samples/s in bf16, model FLOP utilisation, loop overhead, a round.

One prepared script for a machine with a GPU (it also runs on the CPU, where it reports no MFU):
  1. FLOPs of one training sample of the preset (forward and backward), counted with
     torch.utils.flop_counter.FlopCounterMode on a real step;
  2. the site's training loop against the bare forward/backward (bench/training.py's measurement:
     interleaved runs from the same weights; CUDA with bf16 autocast as the agent trains), giving
     samples/s, the loop's overhead (target <= 5%) and the model FLOP utilisation: achieved FLOP/s
     over the GPU's dense bf16 peak (target >= 30%; the peak comes from a table of known GPUs, or
     --peak-tflops);
  3. optionally the same bare step under torch.compile;
  4. a batch's host-to-device copy from pageable and from pinned memory;
  5. one demo round (`cardiofl demo`: a coordinator and site agents as processes) with the agents on
     the GPU, and the device their logs say they trained on.
Writes JSON (default bench/results/gpu.json).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from benchlib import RESULTS_DIR, in_workdir, print_table, write_results
from torch.utils.flop_counter import FlopCounterMode
from training import bare_steps
from training import measure as measure_loop

from shared.model.network import build_model, preset
from shared.terms import TrainingConfig
from site_agent.algorithms.base import make_optimizer
from site_agent.data import ChallengeSource, open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.device import Runtime, resolve_runtime

DEFAULT_OUT = RESULTS_DIR / "gpu.json"
TARGET_OVERHEAD_PERCENT = 5.0
TARGET_MFU = 0.30

# Dense bf16 tensor-core peaks in TFLOP/s (vendor data sheets, without sparsity), first match wins.
BF16_PEAK_TFLOPS = [
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.1),
    ("L4", 121.0),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper", help="model preset (default paper)")
    parser.add_argument("--batch-size", type=int, default=64, help="training batch (default 64)")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed run (default 30)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed runs of each loop; median reported")
    parser.add_argument("--records", type=int, default=600, help="synthetic records of the site (default 600)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, if the table lacks it")
    parser.add_argument("--compile", action="store_true", help="also time the bare step under torch.compile")
    parser.add_argument("--demo-sites", type=int, default=2, help="sites of the demo round (0: no demo round)")
    parser.add_argument("--demo-records", type=int, default=200, help="synthetic records per demo site")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where data, caches and the demo go (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return parser.parse_args(argv)


def peak_tflops(runtime: Runtime, given: float | None) -> float | None:
    """The device's dense bf16 peak in TFLOP/s: `given`, else the table's; None on the CPU or an unknown GPU."""
    if given is not None:
        return given
    if runtime.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(runtime.device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


def training_flops_per_sample(name: str, runtime: Runtime, batch_size: int, seed: int) -> float:
    """FLOPs of one training step (forward, BCE, backward) of preset `name` per sample, as FlopCounterMode counts."""
    config = preset(name, "6:2")
    model = build_model(config, seed=seed).to(runtime.device).train()
    x = torch.randn(batch_size, config.n_leads, config.signal_len, device=runtime.device)
    y = torch.zeros(batch_size, config.n_classes, device=runtime.device)
    counter = FlopCounterMode(display=False)
    with counter:
        with runtime.autocast():
            logits = model(x)
        F.binary_cross_entropy_with_logits(logits.float(), y).backward()
    return counter.get_total_flops() / batch_size


def compiled_samples_per_s(name: str, runtime: Runtime, args: argparse.Namespace) -> float:
    """Samples/s of the bare step with the model under torch.compile (after a warm-up that compiles it)."""
    config = preset(name, "6:2")
    model = build_model(config, seed=args.seed).to(runtime.device)
    compiled = torch.compile(model)
    optimizer = make_optimizer(model, TrainingConfig(batch_size=args.batch_size))
    x = torch.randn(args.batch_size, config.n_leads, config.signal_len, device=runtime.device)
    y = (torch.rand(args.batch_size, config.n_classes, device=runtime.device) < 0.3).float()
    bare_steps(compiled, optimizer, runtime, x, y, 2)  # compiles
    return min(
        args.steps * args.batch_size / bare_steps(compiled, optimizer, runtime, x, y, args.steps) for _ in range(3)
    )


def host_to_device_gb_s(name: str, runtime: Runtime, batch_size: int) -> dict[str, float] | None:
    """GB/s of copying one input batch to the GPU from pageable and from pinned host memory; None on the CPU."""
    if runtime.device.type != "cuda":
        return None
    config = preset(name, "6:2")
    pageable = torch.randn(batch_size, config.n_leads, config.signal_len)
    rates = {}
    for kind, source in (("pageable", pageable), ("pinned", pageable.pin_memory())):
        source.to(runtime.device, non_blocking=True)
        torch.cuda.synchronize(runtime.device)
        start = time.perf_counter()
        for _ in range(20):
            source.to(runtime.device, non_blocking=True)
        torch.cuda.synchronize(runtime.device)
        rates[kind] = 20 * source.numel() * source.element_size() / (time.perf_counter() - start) / 1e9
    return rates


def demo_round(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round of `cardiofl demo` (real processes); its wall time and the devices the agents trained on."""
    from cardiofl.demo import DemoPlan, run_demo

    plan = DemoPlan(
        workdir=workdir / "demo",
        sites=args.demo_sites,
        rounds=1,
        preset=args.preset,
        records_per_site=args.demo_records,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    start = time.perf_counter()
    result = run_demo(plan)
    seconds = time.perf_counter() - start
    logs = sorted((plan.workdir / "logs").glob("*.log"))
    return {
        "status": result.study.status,
        "seconds": seconds,
        "agent_devices": sorted({device for log in logs for device in trained_on(log.read_text(errors="replace"))}),
    }


def trained_on(log: str) -> list[str]:
    """The devices an agent's log says it trained on ("... training on cuda:0 (NVIDIA H200, ...)")."""
    return re.findall(r"training on (\S+ \([^)]*\))", log)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every measurement above, on one generated site."""
    runtime = resolve_runtime(args.device)
    folder = generate_sites(workdir / "sites", 1, args.records, args.seed, heterogeneity=0.0)[0]
    site = open_site_data(ChallengeSource(path=folder), workdir / "cache")
    loop_args = argparse.Namespace(
        steps=args.steps,
        paper_steps=args.steps,
        paper_batch_size=args.batch_size,
        batch_size=args.batch_size,
        seed=args.seed,
        repeats=args.repeats,
    )
    loop = measure_loop(args.preset, loop_args, site, runtime)
    flops = training_flops_per_sample(args.preset, runtime, min(args.batch_size, 8), args.seed)
    peak = peak_tflops(runtime, args.peak_tflops)
    achieved = loop["loop_samples_per_s"] * flops / 1e12
    results: dict[str, Any] = {
        "device": runtime.describe(),
        "torch": torch.__version__,
        **loop,
        "train_gflop_per_sample": flops / 1e9,
        "achieved_tflops": achieved,
        "peak_bf16_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "bare_mfu": loop["bare_samples_per_s"] * flops / 1e12 / peak if peak else None,
        "compiled_samples_per_s": compiled_samples_per_s(args.preset, runtime, args) if args.compile else None,
        "host_to_device_gb_s": host_to_device_gb_s(args.preset, runtime, args.batch_size),
        "demo_round": demo_round(workdir, args) if args.demo_sites > 0 else None,
    }
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table and its ratios, write the JSON results."""
    args = parse_args(argv)
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    print(f"device: {results['device']}; torch {results['torch']}")
    print_table(
        [results],
        [
            ("preset", "preset"),
            ("batch_size", "batch"),
            ("bare_samples_per_s", "bare samples/s"),
            ("loop_samples_per_s", "loop samples/s"),
            ("overhead_percent", "overhead %"),
            ("train_gflop_per_sample", "GFLOP/sample"),
            ("achieved_tflops", "TFLOP/s"),
        ],
    )
    if results["compiled_samples_per_s"] is not None:
        print(f"torch.compile bare step: {results['compiled_samples_per_s']:.1f} samples/s")
    if results["host_to_device_gb_s"] is not None:
        rates = results["host_to_device_gb_s"]
        print(f"host to device, one batch: pageable {rates['pageable']:.1f} GB/s, pinned {rates['pinned']:.1f} GB/s")
    demo = results["demo_round"]
    if demo is not None:
        print(f"demo round: {demo['status']} in {demo['seconds']:.1f} s; agents trained on {demo['agent_devices']}")
    print(
        f"ratio training loop overhead over bare forward/backward: {results['overhead_percent']:.1f}% "
        f"(target <= {TARGET_OVERHEAD_PERCENT:.0f}%)"
    )
    if results["mfu"] is None:
        print(f"ratio model FLOP utilisation: n/a (no bf16 peak known for {results['device']}; give --peak-tflops)")
    else:
        print(
            f"ratio model FLOP utilisation: {results['mfu']:.3f} of {results['peak_bf16_tflops']:.0f} TFLOP/s "
            f"(bare step {results['bare_mfu']:.3f}; target >= {TARGET_MFU})"
        )
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
