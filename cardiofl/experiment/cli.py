"""`cardiofl experiment run|report`: simulate a grid of federated studies in one process, then tabulate and plot it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import ProgressColumn, Task
from rich.text import Text

from cardiofl.tracking_cli import MlflowOption

if TYPE_CHECKING:
    from cardiofl.experiment.config import RunKey
    from cardiofl.experiment.grid import Placement
    from cardiofl.experiment.progress import GridTally


OnRound = Callable[["RunKey", dict[str, Any]], None]


class Backend(StrEnum):
    """Where the runs of a grid go."""

    LOCAL = "local"
    RAY = "ray"


class SiteParallelism(StrEnum):
    """Where the sites of a simulated round go."""

    NONE = "none"  # one after another in the run's process
    RAY = "ray"  # each a Ray task


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
SiteParallelismOption = Annotated[
    SiteParallelism,
    typer.Option(help="ray: each round's sites as Ray tasks, the server step here (same theta^g, bit for bit)."),
]
AddressOption = Annotated[
    str | None,
    typer.Option(help="The Ray cluster (with ray above; default: RAY_ADDRESS, else a Ray started for the run)."),
]


def _placement(backend: Backend, sites: SiteParallelism, address: str | None, jobs: int) -> Placement:
    """Where the grid's work goes; exits 2 on options that do not go together, or Ray asked for without Ray."""
    from cardiofl.experiment.grid import Placement

    on_ray = backend is Backend.RAY or sites is SiteParallelism.RAY
    if not on_ray:
        if address is not None:
            typer.echo("error: --address names a Ray cluster: give --backend ray or --site-parallelism ray", err=True)
            raise typer.Exit(2)
        return Placement(jobs=jobs)
    if jobs > 1:
        typer.echo("error: --jobs runs worker processes here; on Ray the cluster sets what runs at once", err=True)
        raise typer.Exit(2)
    if importlib.util.find_spec("ray") is None:
        typer.echo('error: Ray is not installed: pip install "cardiofl[ray]"', err=True)
        raise typer.Exit(2)
    return Placement(
        ray_address=address or os.environ.get("RAY_ADDRESS") or "local",
        runs_on_ray=backend is Backend.RAY,
        sites_on_ray=sites is SiteParallelism.RAY,
    )


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
    site_parallelism: SiteParallelismOption = SiteParallelism.NONE,
    address: AddressOption = None,
) -> None:
    """Run every (method, head split, seed) not finished yet in RESULTS; an interrupted run resumes there.

    With --mlflow and/or --tensorboard each run is also tracked: its key and terms, each round's
    scalars (train loss, every site's personalised model, the pooled Global model, epsilon) and theta^g_T.
    A run that fails is named and the others go on; the command then exits 1 (a rerun tries it again).
    """
    from cardiofl.experiment.config import load_experiment
    from cardiofl.experiment.grid import GridFailed, finished_runs, run_experiment
    from cardiofl.experiment.progress import GridTally
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
    placement = _placement(backend, site_parallelism, address, jobs)
    results = results or Path("results") / f"{experiment.name}.jsonl"
    console = Console()
    runtime = resolve_runtime(experiment.device)
    runs = experiment.runs()
    done = finished_runs(results) & {key.id for key in runs}
    console.print(f"{experiment.name}: {len(runs)} runs on {runtime.describe()}, {len(done)} already in {results}")
    tally = GridTally(len(runs), len(done), say=console.print)

    def trackers(key: RunKey) -> list[Tracker]:
        folder = tensorboard / run_slug(key) if tensorboard is not None else None
        return open_trackers(mlflow, mlflow_experiment or experiment.name, key.id, folder)

    tracked = trackers if mlflow is not None or tensorboard is not None else None
    failed = False
    with grid_progress(console, tally, experiment.rounds + 1) as on_round:
        try:
            run_experiment(
                experiment,
                results,
                runtime=runtime,
                on_round=on_round,
                trackers=tracked,
                placement=placement,
                tally=tally,
            )
        except GridFailed as exc:
            console.print(f"[red]{exc}")
            failed = True
    if report and results.exists():
        written = write_report(results, results.with_suffix(""))
        typer.echo(written["table.md"].read_text())
        typer.echo(f"report: {', '.join(str(p) for p in written.values())}")
    if failed:
        raise typer.Exit(1)


@contextmanager
def grid_progress(console: Console, tally: GridTally, rounds: int) -> Iterator[OnRound]:
    """A live bar of the grid (done / running / failed / queued, ETA) and of the run last heard of; yields on_round."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    class TallyColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(tally.line() if task.fields.get("grid") else "")

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TallyColumn(),
        console=console,
    ) as progress:
        overall = progress.add_task("runs", total=tally.total, completed=tally.done, grid=True)
        per_run = progress.add_task("rounds", total=rounds)

        def on_round(key: RunKey, record: dict[str, Any]) -> None:
            progress.update(per_run, description=key.id, completed=record["round"])
            for line in external_lines(key.id, record):
                progress.console.print(line)
            if record["kind"] == "evaluate":
                progress.advance(overall)
                glob = record["previous_global"] or {}
                progress.console.print(f"{key.id}: global micro-F1 {glob.get('micro_f1')}, mAP {glob.get('map')}")

        yield on_round
        progress.update(overall, completed=tally.done)


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
