"""Benchmark: one epoch over the memory-mapped cache vs re-parsing every WFDB record, on the same records.

Generates a synthetic site (or reads a Challenge-layout folder given with --data), builds the cache,
then times (a) a full re-parse: wfdb header + signal + FedCVD preprocessing of every record, what each
epoch would cost without the cache, (b) plain `wfdb.rdrecord` of every record, a lower bound for any
uncached loader, and (c) an epoch of `iterate_batches` over the cache. Prints the times and ratios and
writes them as JSON (default bench/results/data_loading.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import wfdb
from benchlib import in_workdir, median_time, write_results

from site_agent.data import ChallengeSource, iterate_batches, open_site_data
from site_agent.data.config import PreprocessConfig
from site_agent.data.scan import inspect_source
from site_agent.data.sources import list_records
from site_agent.data.synthetic import generate_sites

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "data_loading.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300, help="synthetic records to generate (default 300)")
    parser.add_argument("--data", type=Path, help="an existing Challenge-layout folder instead of synthetic data")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where data and cache go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, float | int | str]:
    """Prepare the data and cache under `workdir`, then time the three ways of reading it."""
    if args.data is not None:
        data_dir = args.data
        generate_s = 0.0
    else:
        start = time.perf_counter()
        # One site at 500 Hz, no corrupt files: every record is loaded, so both sides see the same records.
        data_dir = generate_sites(workdir / "sites", 1, args.records, args.seed, heterogeneity=0.0)[0]
        generate_s = time.perf_counter() - start
    source = ChallengeSource(path=data_dir)

    start = time.perf_counter()
    site = open_site_data(source, workdir / "cache")
    build_s = time.perf_counter() - start
    loaded = len(site.train) + len(site.test)
    if loaded == 0:
        raise SystemExit(f"no usable records in {data_dir}")

    reparse_s = median_time(lambda: inspect_source(source, PreprocessConfig()), args.repeats)
    paths = [ref.path for ref in list_records(source)]
    rdrecord_s = median_time(lambda: [wfdb.rdrecord(str(p)) for p in paths], args.repeats)

    def epoch() -> None:
        for split in (site.train, site.test):
            # Each batch is copied out of the memmap into fresh tensors: that copy is the work measured.
            for _batch in iterate_batches(split, args.batch_size, shuffle=True):
                pass

    first_epoch_s = median_time(epoch, 1)  # maps the pages; later epochs find them mapped and cached
    epoch_s = median_time(epoch, args.repeats)
    return {
        "records_found": len(paths),
        "records_loaded": loaded,
        "batch_size": args.batch_size,
        "generate_s": round(generate_s, 4),
        "cache_build_s": round(build_s, 4),
        "reparse_s": round(reparse_s, 4),
        "rdrecord_only_s": round(rdrecord_s, 4),
        "cache_first_epoch_s": round(first_epoch_s, 5),
        "cache_epoch_s": round(epoch_s, 5),
        "ratio_reparse_over_cache": round(reparse_s / epoch_s, 1),
        "ratio_rdrecord_over_cache": round(rdrecord_s / epoch_s, 1),
        "data": str(data_dir) if args.data is not None else "synthetic",
    }


def main(argv: list[str] | None = None) -> dict[str, float | int | str]:
    """Run the benchmark, print the times and ratios, write the JSON results."""
    args = parse_args(argv)
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    print(f"records: {results['records_loaded']} loaded of {results['records_found']}")
    print(f"full re-parse (wfdb + preprocessing): {results['reparse_s']:.3f} s")
    print(f"wfdb.rdrecord only:                   {results['rdrecord_only_s']:.3f} s")
    print(f"first epoch over the cache:           {results['cache_first_epoch_s']:.4f} s")
    print(f"epoch over the cache (median):        {results['cache_epoch_s']:.4f} s")
    print(f"ratio re-parse / cache epoch:   {results['ratio_reparse_over_cache']:.1f}x (target >= 20x)")
    print(f"ratio rdrecord / cache epoch:   {results['ratio_rdrecord_over_cache']:.1f}x")
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
