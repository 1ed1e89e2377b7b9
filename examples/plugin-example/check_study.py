"""A study of the plug-in's model and algorithm through the service and through cardiofl's runner, bit for bit.

Run it where cardiofl and this package are installed (as wheels, not editable: sites refuse editable
plug-ins), from any folder but the source tree's:

    python check_study.py --workdir /tmp/plugin-study

It starts a coordinator and two site agents as processes on 127.0.0.1 (`cardiofl demo`'s machinery),
runs a study of `compact_cnn` under `fedprox_adaptive` on synthetic sites, downloads every round's
global model, then runs the same terms on the same site data with cardiofl's runner
(`simulate_study`) and checks that every global model is identical, tensor by tensor and bit by bit.
It exits non-zero when anything differs, and prints the study's table either way.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cardiofl.client.http import CardioflClient
from cardiofl.demo import DemoPlan, run_demo, source_for
from cardiofl.experiment.runner import simulate_study
from shared.tensors.codec import load
from shared.terms import StudyTerms
from shared.wire.api import StudyPublic
from shared.wire.metrics import MetricSummary, PooledMetrics
from site_agent.data import open_site_data, parse_source
from site_agent.device import resolve_runtime

MODEL, ALGORITHM = "compact_cnn", "fedprox_adaptive"
console = Console()


def plan_for(workdir: Path, rounds: int, records: int) -> DemoPlan:
    """Two synthetic sites, a few short rounds of the plug-ins, pooled statistics from 10 test records."""
    return DemoPlan(
        workdir=workdir,
        sites=2,
        rounds=rounds,
        heads="-",
        preset=MODEL,
        records_per_site=records,
        optimizer="sgd",
        lr=0.05,
        batch_size=16,
        algorithm=ALGORITHM,
        algorithm_params={"mu": 0.05, "step": 0.1, "patience": 1},
        min_records=10,
    )


def _fixed(value: float | None, digits: int) -> str:
    """A figure with `digits` decimals, or nan when the coordinator reported none."""
    return f"{value if value is not None else float('nan'):.{digits}f}"


def main() -> int:
    """Run both, compare, print; 0 when every round's global model is the same."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=80)
    args = parser.parse_args()
    plan = plan_for(args.workdir.resolve(), args.rounds, args.records)
    service: dict[int, dict[str, torch.Tensor]] = {}
    terms: list[StudyTerms] = []

    def download(api: CardioflClient, study: StudyPublic) -> None:
        terms.append(study.config)
        for entry in api.global_models(study.id):
            if entry.round > 0:
                service[entry.round] = load(api.download_global_model(study.id, entry.round))[0]

    result = run_demo(plan, then=download)
    if result.study.status != "completed":
        console.print(f"[red]the study ended {result.study.status}[/red]")
        return 1
    (study,) = terms
    model_plugin, algorithm_plugin = study.model.plugin, study.algorithm.plugin
    if model_plugin is None or algorithm_plugin is None:
        console.print("[red]the terms do not name the plug-ins[/red]")
        return 1
    # the agents ran with cpu_count // sites threads each (cardiofl demo); the runner does too
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(result.sites)))
    cache = plan.workdir / "runner-cache"
    data = {
        site: open_site_data([parse_source(source_for(folder)) for folder in folders], cache / site)
        for site, folders in result.sites.items()
    }
    outcomes = list(simulate_study(study, data, resolve_runtime("cpu"), evaluate_final=False))
    # the sites' own models after round t (their mean), as in `cardiofl demo`'s line for round t
    table = Table("round", "tensors", "train loss", "own micro-F1", "own mAP", "service = runner")
    failed = False
    pooled = {r.number: r.pooled or PooledMetrics() for r in result.rounds}
    for outcome in outcomes:
        t, ours = outcome.round, outcome.global_model
        theirs = service.get(t, {})
        same = set(theirs) == set(ours) and all(torch.equal(ours[n], theirs[n]) for n in ours)
        failed |= not same
        stats = pooled.get(t, PooledMetrics())
        local = stats.local_eval or MetricSummary()
        table.add_row(
            str(t),
            str(len(ours)),
            _fixed(stats.train_loss, 4),
            _fixed(local.micro_f1, 3),
            _fixed(local.map, 3),
            "bit-identical" if same else "[red]DIFFERS[/red]",
        )
    console.print(
        f"study {result.study.id}: model {MODEL} from {model_plugin.distribution} {model_plugin.version}, "
        f"algorithm {ALGORITHM} from {algorithm_plugin.distribution} {algorithm_plugin.version} "
        f"(files sha256 {algorithm_plugin.sha256[:16]})"
    )
    console.print(table)
    if len(outcomes) != args.rounds or set(service) != set(range(1, args.rounds + 1)):
        console.print(f"[red]rounds: service {sorted(service)}, runner {len(outcomes)}[/red]")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
