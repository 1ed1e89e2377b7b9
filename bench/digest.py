"""Benchmark: sha256 (hashlib) against BLAKE3 (the `blake3` package) over θ^g-sized bodies in memory.

It decides which digest names updates and models. sha256 is the protocol's identity of a blob:
the coordinator hashes every upload as it arrives (coordinator/api/deps.py, spooled into the blob
store) and θ^g_t once when it stores it (coordinator/rounds/closing.py); downloads' ETags, the
approvals and the signed advertisements reuse stored digests or hash a few kB of JSON. A K-site
round therefore hashes K + 1 models on the coordinator.

Rows per size: sha256, BLAKE3 on one thread, BLAKE3 on every core (`max_threads=blake3.AUTO`);
best of the repeats, interleaved so that interference hits each the same. The BLAKE3 rows are
skipped, with the reason, where the package is not installed (`pip install blake3`). Then the
digests' CPU seconds per K-site round of the first size against the round's measured coordinator CPU.
Lines `ratio sha256 over blake3: <ratio>` (one per size; above 1: BLAKE3 is faster) end the output.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import RESULTS_DIR, print_table, write_results  # noqa: E402

Digest = Callable[[bytes], str]
ROUND_CPU_S = 1.65  # coordinator CPU s per K = 4 round of the paper model (bench/round_overhead.py: 1.6 to 2.3 s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="paper,1000", help="comma-separated MB or model presets (default paper,1000: θ^g and 1 GB)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="passes per digest and size, best counts (default 5)")
    parser.add_argument("--sites", type=int, default=4, help="K for the digests' share of a round (default 4)")
    parser.add_argument("--round-cpu", type=float, default=ROUND_CPU_S, help="coordinator CPU s per round to compare")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "digest.json")
    return parser.parse_args(argv)


def size_of(name: str) -> int:
    """Bytes of a size given as MB (10^6 bytes) or as a model preset (its θ^g as the coordinator stores it)."""
    if name.replace(".", "", 1).isdigit():
        return int(float(name) * 1_000_000)
    from shared.study.rules import initial_state
    from shared.tensors.codec import dump
    from shared.terms import ModelSpec, StudyTerms

    shared, _ = initial_state(StudyTerms(model=ModelSpec(preset=name, heads="6:2"), sites=["bench"]))
    return len(dump(shared))


def digests() -> tuple[dict[str, Digest], dict[str, str]]:
    """The digests to time, by name, and those skipped with the reason."""
    ways: dict[str, Digest] = {"sha256": lambda data: hashlib.sha256(data).hexdigest()}
    if importlib.util.find_spec("blake3") is None:
        why = "the blake3 package is not installed (pip install blake3)"
        return ways, {"blake3 1 thread": why, "blake3 all cores": why}
    import blake3

    ways["blake3 1 thread"] = lambda data: blake3.blake3(data).hexdigest()
    ways["blake3 all cores"] = lambda data: blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
    return ways, {}


def measure(label: str, nbytes: int, ways: dict[str, Digest], repeats: int) -> list[dict[str, Any]]:
    """One row per digest over `nbytes` random bytes: best wall and CPU seconds of `repeats` interleaved passes."""
    data = os.urandom(nbytes)  # bytes: blake3 hashes a memoryview on one thread only
    wall: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, digest in ways.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            digest(data)
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
    rows = []
    for name in ways:
        best = min(wall[name])
        rows.append(
            {
                "size": label,
                "bytes": nbytes,
                "digest": name,
                "wall_s": best,
                "cpu_s": min(cpu[name]),
                "gb_per_s": nbytes / best / 1e9,
                "sha256_over_this": min(wall["sha256"]) / best,
            }
        )
    return rows


def round_share(rows: list[dict[str, Any]], sites: int, round_cpu: float) -> list[dict[str, Any]]:
    """Per digest: the CPU seconds of hashing K + 1 models (K uploads, θ^g_t) and their share of `round_cpu`."""
    shares = []
    for row in rows:
        seconds = row["cpu_s"] * (sites + 1)
        shares.append(
            {
                "digest": row["digest"],
                "bytes_per_round": (sites + 1) * row["bytes"],
                "cpu_s_per_round": seconds,
                "share_of_round_cpu": seconds / round_cpu,
            }
        )
    return shares


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the tables and the ratio lines, write the JSON results."""
    args = parse_args(argv)
    ways, skipped = digests()
    rows: list[dict[str, Any]] = []
    for label in args.sizes.split(","):
        rows += measure(label, size_of(label), ways, args.repeats)
    first = [row for row in rows if row["size"] == rows[0]["size"]]
    shares = round_share(first, args.sites, args.round_cpu)
    cores = os.cpu_count()
    results = {"repeats": args.repeats, "cores": cores, "rows": rows, "skipped": skipped, "round": shares}
    results |= {"sites": args.sites, "round_cpu_s": args.round_cpu}
    print(f"best of {args.repeats}, in memory, {cores} cores")
    columns = [("size", "size"), ("bytes", "bytes"), ("digest", "digest"), ("wall_s", "wall s"), ("cpu_s", "CPU s")]
    print_table(rows, [*columns, ("gb_per_s", "GB/s"), ("sha256_over_this", "sha256 / this")])
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}")
    hashed = f"{args.sites} uploads hashed on arrival, θ^g_t when stored"
    print(f"\nK = {args.sites} round of {first[0]['size']} ({hashed}), against {args.round_cpu} s of coordinator CPU:")
    columns = [("digest", "digest"), ("bytes_per_round", "bytes hashed"), ("cpu_s_per_round", "CPU s")]
    print_table(shares, [*columns, ("share_of_round_cpu", "share of round")])
    write_results(args.out, results)
    for label in dict.fromkeys(row["size"] for row in rows):
        ratio = {row["digest"]: row["sha256_over_this"] for row in rows if row["size"] == label}
        shown = "n/a (blake3 not installed)"
        if "blake3 1 thread" in ratio:
            shown = f"{ratio['blake3 1 thread']:.2f} (one thread; {ratio['blake3 all cores']:.2f} on all cores)"
        print(f"size {label}: ratio sha256 over blake3: {shown}")
    return results


if __name__ == "__main__":
    main()
