"""Benchmark: what exact discrete noise costs, against NumPy's floating-point normal drawn in the same run.

For each preset (its upload's d floating values) and the study settings given (z, C, f = 24), times
(best of `--repeats`, seconds on one core):
- `discrete`: shared.privacy.discrete.DiscreteGaussian.sample of d values at the sum's variance
  (z Delta)^2 in grid steps, the coordinator's central noise;
- `normal`: numpy.random.Generator.standard_normal(d), the floating-point baseline (not usable as DP
  noise: its support and tails betray it, see docs/data-owner/privacy.md);
- `release`: a site's whole secure release (shared.study.dp.release_update: clip, conditional
  randomized rounding, its distributed noise share for h = 2) of a random change of norm 1.
Prints each figure with its ratio to `normal` measured in this run, and writes JSON (default
bench/results/dp_noise.json).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from benchlib import RESULTS_DIR, print_table, write_results

from shared.privacy.discrete import DiscreteGaussian
from shared.study.dp import norm_bound, release_update, sum_noise_variance
from shared.study.rules import shared_schema
from shared.terms import StudyTerms

DEFAULT_OUT = RESULTS_DIR / "dp_noise.json"
BITS = 24


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,paper", help="comma-separated model presets (default small,paper)")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--clip-norm", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each figure; the best reported")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    return parser.parse_args(argv)


def best_seconds(function: Callable[[], object], repeats: int) -> float:
    """The least wall time of `repeats` calls (each runs on one core: wall is its CPU time)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def measure(preset: str, settings: SimpleNamespace, repeats: int) -> dict[str, object]:
    """One preset's row: d, the three CPU times and their ratios to the floating-point normal."""
    schema = shared_schema(StudyTerms(sites=["a", "b"], model={"preset": preset}))
    floating = {name: spec for name, spec in schema.items() if spec.dtype.is_floating_point}
    size = sum(spec.numel for spec in floating.values())
    variance = sum_noise_variance(settings, size, BITS)  # type: ignore[arg-type]
    sampler, generator = DiscreteGaussian(), np.random.default_rng()
    previous = {name: torch.zeros(spec.shape) for name, spec in floating.items()}
    trained = {name: torch.randn(spec.shape) / size**0.5 for name, spec in floating.items()}
    discrete = best_seconds(lambda: sampler.sample(size, variance), repeats)
    normal = best_seconds(lambda: generator.standard_normal(size), repeats)
    release = best_seconds(
        lambda: release_update(trained, previous, settings, fraction_bits=BITS, secure=True, quorum=2),  # type: ignore[arg-type]
        repeats,
    )
    delta = float(norm_bound(settings.clip_norm, size, BITS))
    return {
        "preset": preset,
        "values": size,
        "sigma_steps": round(settings.noise_multiplier * delta),
        "discrete_s": round(discrete, 6),
        "normal_s": round(normal, 6),
        "release_s": round(release, 6),
        "discrete_per_normal": round(discrete / normal, 2),
        "release_per_normal": round(release / normal, 2),
        "discrete_ns_per_value": round(discrete / size * 1e9, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run every preset, print the table, write the JSON; return the results."""
    args = parse_args(argv)
    settings = SimpleNamespace(noise_multiplier=args.noise_multiplier, clip_norm=args.clip_norm, mode="distributed")
    rows = [measure(preset, settings, args.repeats) for preset in args.presets.split(",")]
    print_table(
        rows,
        [
            ("preset", "preset"),
            ("values", "d"),
            ("sigma_steps", "sigma (steps)"),
            ("discrete_s", "discrete s"),
            ("normal_s", "normal s"),
            ("release_s", "release s"),
            ("discrete_per_normal", "discrete / normal"),
            ("release_per_normal", "release / normal"),
            ("discrete_ns_per_value", "ns / value"),
        ],
    )
    results = {"settings": vars(args), "rows": rows}
    write_results(Path(args.out), results)
    for row in rows:
        print(f"ratio exact discrete noise over float normal ({row['preset']}): {row['discrete_per_normal']}")
    return results


if __name__ == "__main__":
    main()
