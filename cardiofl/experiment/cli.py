"""`cardiofl experiment run|report`: simulate a grid of federated studies in one process, then tabulate and plot it."""

from __future__ import annotations

import importlib.util
import os
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cardiofl.tracking_cli import MlflowOption

if TYPE_CHECKING:
    from cardiofl.experiment.config import RunKey


class Backend(StrEnum):
    """Where the runs of a grid go."""

    LOCAL = "local"
    RAY = "ray"


MlflowExperimentOption = Annotated[str | None, typer.Option(help="MLflow experiment (default: the experiment's name).")]
TensorboardOption = Annotated[
    Path | None, typer.Option(help="TensorBoard log directory, one folder a run (extra: cardiofl[tensorboard]).")
]
SeedsOption = Annotated[
    str | None, typer.Option(help="Comma-separated seeds instead of the experiment's (e.g. 0,1,2).")
]
JobsOption = Annotated[
    int, typer.Option(min=1, help="Runs at a time, each in a worker process of its own (e.g. one a CPU core).")
]
BackendOption = Annotated[
    Backend, typer.Option(help="local: this machine (--jobs); ray: each run a task on a Ray cluster.")
]
AddressOption = Annotated[
    str | None,
    typer.Option(help="The Ray cluster (--backend ray; default: RAY_ADDRESS, else a Ray started for the run)."),
]


def _ray_cluster(backend: Backend, address: str | None) -> str | None:
    """The Ray cluster the runs go to (None: this machine); exits 2 on --address alone, or without Ray installed."""
    if backend is Backend.LOCAL:
        if address is not None:
            typer.echo("error: --address names a Ray cluster: give --backend ray with it", err=True)
            raise typer.Exit(2)
        return None
    if importlib.util.find_spec("ray") is None:
        typer.echo('error: --backend ray needs Ray: pip install "cardiofl[ray]"', err=True)
        raise typer.Exit(2)
    return address or os.environ.get("RAY_ADDRESS") or "local"


experiment_app = typer.Typer(help="Reproduce FedDualAtt's Table I and ablations in one process.", no_args_is_help=True)


@experiment_app.command("run")
def run_command(
    config: Annotated[
        str,
        typer.Argument(
            help="Experiment TOML file, or a shipped one: cpu, cpu-real, auto-heads, auto-heads-real, "
            "auto-heads-planted, auto-heads-planted-separated, paper."
        ),
    ],
    results: Annotated[Path | None, typer.Option(help="JSON-lines results (default: results/<name>.jsonl).")] = None,
    report: Annotated[bool, typer.Option(help="Write the report next to the results when done.")] = True,
    mlflow: MlflowOption = None,
    mlflow_experiment: MlflowExperimentOption = None,
    tensorboard: TensorboardOption = None,
    seeds: SeedsOption = None,
    jobs: JobsOption = 1,
    backend: BackendOption = Backend.LOCAL,
    address: AddressOption = None,
) -> None:
    """Run every (method, head split, seed) not finished yet in RESULTS; an interrupted run resumes there.

    With --mlflow and/or --tensorboard each run is also tracked: its key and terms, each round's
    scalars (train loss, every site's personalised model, the pooled Global model, epsilon) and theta^g_T.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from cardiofl.experiment.config import load_experiment
    from cardiofl.experiment.grid import finished_runs, run_experiment
    from cardiofl.experiment.report import write_report
    from cardiofl.experiment.runner import run_slug
    from cardiofl.tracking import Tracker, open_trackers
    from site_agent.device import resolve_runtime

    try:
        experiment = load_experiment(config)
        if seeds is not None:
            experiment = experiment.with_seeds([int(seed) for seed in seeds.split(",")])
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    cluster = _ray_cluster(backend, address)
    results = results or Path("results") / f"{experiment.name}.jsonl"
    console = Console()
    runtime = resolve_runtime(experiment.device)
    runs = experiment.runs()
    done = finished_runs(results) & {key.id for key in runs}
    console.print(f"{experiment.name}: {len(runs)} runs on {runtime.describe()}, {len(done)} already in {results}")
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        overall = progress.add_task("runs", total=len(runs), completed=len(done))
        per_run = progress.add_task("rounds", total=experiment.rounds + 1)

        def on_round(key: RunKey, record: dict[str, Any]) -> None:
            progress.update(per_run, description=key.id, completed=record["round"])
            for line in external_lines(key.id, record):
                progress.console.print(line)
            if record["kind"] == "evaluate":
                progress.advance(overall)
                glob = record["previous_global"] or {}
                progress.console.print(f"{key.id}: global micro-F1 {glob.get('micro_f1')}, mAP {glob.get('map')}")

        def trackers(key: RunKey) -> list[Tracker]:
            folder = tensorboard / run_slug(key) if tensorboard is not None else None
            return open_trackers(mlflow, mlflow_experiment or experiment.name, key.id, folder)

        tracked = trackers if mlflow is not None or tensorboard is not None else None
        run_experiment(
            experiment, results, runtime=runtime, on_round=on_round, trackers=tracked, jobs=jobs, ray_address=cluster
        )
    if report:
        written = write_report(results, results.with_suffix(""))
        typer.echo(written["table.md"].read_text())
        typer.echo(f"report: {', '.join(str(p) for p in written.values())}")


@experiment_app.command("report")
def report_command(
    results: Annotated[Path, typer.Argument(help="A results file written by `cardiofl experiment run`.")],
    out: Annotated[
        Path | None, typer.Option(help="Folder for table.md/.csv and the plots (default: next to it).")
    ] = None,
) -> None:
    """Table I (per-site and global micro-F1/mAP, mean±std over seeds), Fig. 2 deltas vs 8:0, curves, learned gates."""
    from cardiofl.experiment.report import write_report

    try:
        written = write_report(results, out or results.with_suffix(""))
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(written["table.md"].read_text())
    typer.echo("wrote " + ", ".join(str(p) for p in written.values()))


def external_lines(run: str, record: dict[str, Any]) -> list[str]:
    """One line per validation site of a round record that holds its evaluation of theta^g_t."""
    return [
        f"{run}: {site} (external) on theta^g_{record['round']}: "
        f"micro-F1 {summary.get('micro_f1')}, mAP {summary.get('map')}"
        for site, summary in (record.get("external") or {}).items()
    ]
