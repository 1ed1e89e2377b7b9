"""Benchmark: secure aggregation (SecAgg+) rounds against plain ones, cardiofl and Flower, through real processes.

For each K: cardiofl plain and secure (`cardiofl coordinator serve` on SQLite + K echo agents; the
secure study has `[privacy] secure_aggregation` and its agents drive each round's phases with
site_agent.secure_round.SecureRound), then Flower 1.42 plain and SecAgg+ (SuperLink + K SuperNodes
+ bench/flower_echo with `secure = true`: SecAggPlusWorkflow and secaggplus_mod), all exchanging
the preset's theta^g with no training. The first round of each run is a warm-up and is not timed.

Both sides use cardiofl's SecAgg+ parameters against its default adversary, c = (K - 1) // 3 sites
colluding with the coordinator (shared/privacy/graph.py adversary_parameters): up to 100 sites the
complete graph, k = K - 1 neighbours, and the split-proof t = floor((k + c) / 2) + 1. Flower's `num_shares`
counts the client itself, so it is k + 1, and its `reconstruction_threshold` is t. cardiofl's
secure round includes what a malicious coordinator makes necessary: Ed25519-signed advertisements,
every site checking every signature, and the consistency phase (survivors sign the survivor set).

Figures per K: seconds per round of each, cardiofl secure / cardiofl plain (target <= 2) and
cardiofl secure / Flower SecAgg+ (target <= 0.5); cardiofl's CPU seconds per round of one site and
of the coordinator; cardiofl's request and response bodies per round and every system's loopback
bytes per round; and each phase of cardiofl's secure round (advertise, share, masked upload,
consistency, reveal, result) as one site sees it: wall seconds since its previous move, waiting
for the others included, and the CPU seconds it spent. All K agents share this machine's cores,
so a site's masking work (one keystream per neighbour, over the whole ring vector) is paid K times
over in the wall time here, where real sites would each pay it once, in parallel: the CPU column
shows that cost per site. Writes JSON (default bench/results/secure_round.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

from benchlib import RESULTS_DIR, in_workdir, print_table, write_results
from round_overhead import preset_state, run_flower, run_ours

DEFAULT_OUT = RESULTS_DIR / "secure_round.json"
TARGET_OVER_PLAIN = 2.0
TARGET_OVER_FLOWER = 0.5
FLOWER_EXECUTABLES = ("flower-superlink", "flower-supernode", "flwr", "flwr-serverapp", "flwr-clientapp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model preset whose theta^g is exchanged (default small)")
    parser.add_argument("--sites", default="4,8,16", help="comma-separated K values (default 4,8,16)")
    parser.add_argument("--rounds", type=int, default=4, help="cardiofl rounds per run; the first is not timed")
    parser.add_argument("--flower-rounds", type=int, default=3, help="Flower rounds per run; the first is not timed")
    parser.add_argument("--no-flower", action="store_true", help="run cardiofl only")
    parser.add_argument(
        "--flower-bin",
        type=Path,
        help="folder with Flower 1.42's executables, e.g. a venv's bin (default: beside this interpreter)",
    )
    parser.add_argument("--secure-poll-s", type=float, default=0.1, help="echo agents' pause between secure reads")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for one run")
    parser.add_argument("--workdir", type=Path, help="where databases and logs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return parser.parse_args(argv)


def secure_parameters(sites: int) -> dict[str, int]:
    """SecAgg+ parameters of cardiofl for K sites against its default adversary, and the Flower settings to match."""
    from shared.privacy.graph import adversary_parameters

    parameters = adversary_parameters(sites, (sites - 1) // 3)
    neighbours, threshold = parameters.neighbour_count, parameters.threshold
    return {"neighbours": neighbours, "threshold": threshold, "flower_num_shares": neighbours + 1}


def secure_missing() -> str | None:
    """Why cardiofl's secure rounds cannot run from this tree, or None."""
    from shared.terms import PrivacyConfig

    if "secure_aggregation" not in PrivacyConfig.model_fields:
        return "shared.wire.protocol.PrivacyConfig has no secure_aggregation option"
    if importlib.util.find_spec("site_agent.secure_round") is None:
        return "site_agent.secure_round (the agent's SecAgg+ driver) is missing"
    return None


def flower_missing(binaries: Path | None) -> str | None:
    """Why the Flower half cannot run with the executables in `binaries` (None: beside this interpreter), or None."""
    folder = binaries if binaries is not None else Path(sys.executable).parent
    if binaries is None and importlib.util.find_spec("flwr") is None:
        return "flwr is not installed (pip install -e '.[bench]', or --flower-bin a venv's bin with flwr==1.42.0)"
    absent = [name for name in FLOWER_EXECUTABLES if shutil.which(name, path=str(folder)) is None]
    if absent:
        return f"{', '.join(absent)} not in {folder}"
    return None


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """For each K: cardiofl plain and secure, then (when Flower is here) Flower plain and SecAgg+."""
    state = preset_state(args.preset)
    arrays = workdir / "theta.safetensors"
    arrays.write_bytes(state)
    secure_skipped = secure_missing()
    flower_skipped = "--no-flower given" if args.no_flower else flower_missing(args.flower_bin)
    flower_args = argparse.Namespace(**{**vars(args), "rounds": args.flower_rounds})
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for sites in [int(k) for k in args.sites.split(",")]:
        parameters = secure_parameters(sites)
        plain = {"min_sites": sites}  # every site takes part in every round, secure or not
        secure = {**plain, "privacy": {"secure_aggregation": {}}}
        poll = ("--secure-poll-s", str(args.secure_poll_s))
        settings = f"secure=true num-shares={parameters['flower_num_shares']}"
        settings += f" reconstruction-threshold={parameters['threshold']}"
        runs: list[tuple[str, str, dict[str, Any]]] = [("cardiofl", "plain", {"study_config": plain})]
        if secure_skipped is None:
            runs.append(("cardiofl", "secure", {"study_config": secure, "agent_args": poll}))
        if flower_skipped is None:
            runs.append(("flower", "plain", {"binaries": args.flower_bin}))
            runs.append(("flower", "secure", {"binaries": args.flower_bin, "run_config": settings}))
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for system, mode, options in runs:
            folder = workdir / f"{system}-{mode}-{sites}"
            try:
                if system == "cardiofl":
                    found[system, mode] = run_ours(sites, args, folder, len(state), **options)
                else:
                    found[system, mode] = run_flower(sites, flower_args, folder, arrays, **options)
            except SystemExit as exc:  # a run that did not complete: say so, and keep the others
                failed.append({"system": system, "mode": mode, "sites": sites, "error": str(exc)})
                print(f"{system} {mode} K={sites} did not complete: {exc}", file=sys.stderr, flush=True)
        ours, theirs = found.get(("cardiofl", "secure")), found.get(("flower", "secure"))
        for system, row in (("cardiofl", ours), ("flower", theirs)):
            if row is not None and (system, "plain") in found:
                row["secure_over_plain"] = row["s_per_round"] / found[system, "plain"]["s_per_round"]
        if ours is not None and theirs is not None:
            ours["secure_over_flower_secure"] = ours["s_per_round"] / theirs["s_per_round"]
        for row in found.values():  # every echo agent runs on this machine's cores: what one site costs, alone
            if "agents_cpu_s_per_round" in row:
                row["site_cpu_s_per_round"] = row["agents_cpu_s_per_round"] / sites
        rows += [{**row, "system": system, "mode": mode, **parameters} for (system, mode), row in found.items()]
    return {
        "preset": args.preset,
        "model_bytes": len(state),
        "rounds": args.rounds,
        "flower_rounds": args.flower_rounds,
        "secure_skipped": secure_skipped,
        "flower_skipped": flower_skipped,
        "rows": rows,
        "failed": failed,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table and ratios, write the JSON results."""
    args = parse_args(argv)
    results = in_workdir(args.workdir, lambda folder: run(args, folder))
    print(
        f"preset {results['preset']}: theta^g is {results['model_bytes'] / 1e6:.1f} MB; {args.rounds} cardiofl and "
        f"{args.flower_rounds} Flower rounds per run, the first of each not timed"
    )
    megabytes = ("wire_bytes_per_round", "loopback_bytes_per_round", "server_peak_rss")
    print_table(
        [{**row, **{key: row[key] / 1e6 for key in megabytes if key in row}} for row in results["rows"]],
        [
            ("system", "system"),
            ("mode", "mode"),
            ("sites", "K"),
            ("neighbours", "k"),
            ("threshold", "t"),
            ("s_per_round", "s/round"),
            ("secure_over_plain", "secure/plain"),
            ("secure_over_flower_secure", "ours/Flower secure"),
            ("site_cpu_s_per_round", "CPU s/site"),
            ("coordinator_cpu_s_per_round", "server CPU s"),
            ("wire_bytes_per_round", "wire MB"),
            ("loopback_bytes_per_round", "loopback MB"),
            ("server_peak_rss", "server peak RSS MB"),
        ],
    )
    for key, what in (("secure_skipped", "cardiofl's secure rounds"), ("flower_skipped", "Flower half")):
        if results[key]:
            print(f"{what} skipped: {results[key]}")
    for row in results["rows"]:
        if "phases" in row:
            costs = row["phases"].items()
            shown = ", ".join(f"{name} {cost['wall_s']:.2f}/{cost['cpu_s']:.2f}" for name, cost in costs)
            print(f"K={row['sites']} secure phases, wall s / CPU s of one site since its previous move: {shown}")
    for failure in results["failed"]:
        print(f"{failure['system']} {failure['mode']} K={failure['sites']} did not complete: {failure['error']}")
    for row in results["rows"]:
        if (row["system"], row["mode"]) != ("cardiofl", "secure"):
            continue
        over_plain = f"{row['secure_over_plain']:.2f}" if "secure_over_plain" in row else "n/a"
        versus = (
            f"{row['secure_over_flower_secure']:.3f} (target <= {TARGET_OVER_FLOWER})"
            if "secure_over_flower_secure" in row
            else "n/a (Flower skipped)"
        )
        print(
            f"K={row['sites']}: ratio secure / plain round: {over_plain} (target <= "
            f"{TARGET_OVER_PLAIN}); ratio secure round ours / Flower SecAgg+: {versus}"
        )
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
