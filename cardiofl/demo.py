"""`cardiofl demo`: a coordinator and several site agents as real processes on 127.0.0.1, one study end to end."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cardiofl.child_guard import die_with_parent
from cardiofl.client.http import ApiError, CardioflClient
from cardiofl.demo_lifecycle import external_validation, survey_first
from cardiofl.demo_report import DemoReport, round_tables, stopped_lines, table_note
from cardiofl.demo_study import DemoPlan, slow_site, study_config, title
from shared.wire.api import RoundPublic, StudyPublic
from shared.wire.jobs import ExternalResults, SurveyResults

__all__ = ["DemoPlan", "DemoResult", "demo_app", "run_demo"]

console = Console()
demo_app = typer.Typer(help="Run a federated study end to end on this machine.")


@dataclass(frozen=True)
class DemoResult:
    """How the demo's study ended, and where it ran."""

    study: StudyPublic
    rounds: list[RoundPublic]
    dashboard: str  # the read-only dashboard's URL with a viewer token
    pids: list[int]  # every process the demo started (all stopped by now)
    url: str
    sites: dict[str, list[Path]] = field(default_factory=dict)  # each site's data folders
    card: Path | None = None  # the study's model card (Markdown), <workdir>/card.md
    survey: SurveyResults | None = None  # the data-readiness survey run before training
    external: ExternalResults | None = None  # the held-out validation sites' evaluations of the released models


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def source_for(folder: Path) -> dict[str, Any]:
    """The data source config of one folder: PTB-XL layout when it looks like one, else Challenge."""
    ptbxl = (folder / "ptbxl_database.csv").exists() or (folder / "records500").is_dir()
    return {"kind": "ptbxl" if ptbxl else "challenge", "path": str(folder.resolve()), "name": folder.name}


@dataclass
class Processes:
    """Children started by the demo; all are stopped on exit, Ctrl-C included."""

    children: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start `args` with its output in `log`."""
        with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
            child = subprocess.Popen(  # its own session: Ctrl-C reaches the demo, which stops each child in turn
                args,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # noqa: PLW1509 - only prctl runs there, looked up beforehand
            )
        self.children.append((name, child))
        return child

    def check_alive(self, logs: Path) -> None:
        """Fail with the log's tail when a child died early."""
        for name, child in self.children:
            if child.poll() is not None and child.returncode != 0:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with code {child.returncode}:\n{tail}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM everyone, then SIGKILL whoever is still there after `timeout`."""
        for _, child in self.children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


@contextmanager
def managed_processes() -> Iterator[Processes]:
    """Processes that are stopped however the block ends."""
    processes = Processes()
    try:
        yield processes
    finally:
        processes.stop()


def _cardiofl() -> list[str]:
    return [sys.executable, "-m", "cardiofl"]


def _wait_healthy(api: CardioflClient, processes: Processes, logs: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        processes.check_alive(logs)
        try:
            if api.http.get("/api/v1/health").status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the coordinator did not answer within {timeout:.0f}s (see {logs / 'coordinator.log'})")


def _wait_registered(
    api: CardioflClient, names: list[str], processes: Processes, logs: Path, timeout: float = 300.0
) -> None:
    """Wait until every agent registered its signing key (at its first poll): a secure study's terms name them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        processes.check_alive(logs)
        if all(site.signing_key for site in api.sites() if site.name in names):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the site agents did not register their signing keys within {timeout:.0f}s (see {logs})")


def _site_folders(plan: DemoPlan) -> list[list[Path]]:
    if plan.data:
        return plan.data
    from site_agent.data.synthetic import generate_sites

    out = plan.workdir / "data"
    if out.exists():
        shutil.rmtree(out)
    console.print(f"generating {plan.sites} synthetic sites x {plan.records_per_site} records in {out}")
    return [[folder] for folder in generate_sites(out, plan.sites, plan.records_per_site, plan.seed)]


def _write_site_token(plan: DemoPlan, name: str, secret: str) -> Path:
    """The site's token in its own file (mode 600), where its agent's config points."""
    token_file = plan.workdir / "sites" / name / "token"
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.unlink(missing_ok=True)
    token_file.touch(mode=0o600)
    token_file.write_text(secret)
    return token_file


def _keep_dashboard_up(keep_running: bool, dashboard: str) -> None:
    """With --keep-running, wait for Ctrl-C: the coordinator serves the dashboard until then."""
    if not keep_running:  # what stopped, and how to look again, is said once it has (demo_report.stopped_lines)
        return
    console.print(f"dashboard (read-only): {dashboard}", soft_wrap=True)  # one line, whatever the width
    console.print("the coordinator keeps running for the dashboard; press Ctrl-C to stop everything")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass


def _write_site_config(
    plan: DemoPlan, name: str, folders: list[Path], url: str, token_file: Path, *, slowdown: float = 1.0
) -> Path:
    site_dir = plan.workdir / "sites" / name
    key_file = site_dir / "store.key"
    # A new coordinator each run (its database goes): the site's store of the last one goes too, with its
    # record beside the key. A kept store would hold the last run's ledger, whose secure rounds this run's
    # study (the same seed, so the same theta^g_0) repeats: its agent would decline them.
    shutil.rmtree(site_dir / "store", ignore_errors=True)
    key_file.with_name(key_file.name + ".approvals-version").unlink(missing_ok=True)
    if not key_file.exists():
        from site_agent.store import write_key_file

        write_key_file(key_file)
    config = site_dir / "site.toml"
    sources = []
    for folder in folders:
        sources += ["", "[[data]]", *(f"{key} = {json.dumps(value)}" for key, value in source_for(folder).items())]
    config.write_text(
        "\n".join(
            [
                f'name = "{name}"',
                f'coordinator_url = "{url}"',
                f'token_file = "{token_file}"',
                f'store_key_file = "{key_file}"',
                f'store_dir = "{site_dir / "store"}"',
                f'cache_dir = "{site_dir / "cache"}"',
                'device = "auto"',
                "auto_approve = true  # the demo's own studies; a hospital runs `cardiofl site approve`",
                "poll_wait_s = 5",
                "poll_interval_s = 1",
                "max_backoff_s = 10",
                "progress_bar = false",
                f'heartbeat_file = "{site_dir / "heartbeat"}"',
                *([f"slowdown = {slowdown}  # trains {slowdown:g} times slower: a slow hospital"] * (slowdown > 1)),
                *sources,
                "",
            ]
        )
    )
    return config


def _follow(api: CardioflClient, study_id: int, plan: DemoPlan, processes: Processes, logs: Path) -> StudyPublic:
    report = DemoReport(plan.algorithm)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        console=console,
        disable=console.is_jupyter,  # a notebook prints the round lines alone: a live bar there needs ipywidgets
    ) as progress:
        bar = progress.add_task(title(plan), total=plan.rounds, detail="")
        while True:
            processes.check_alive(logs)
            study = api.study(study_id)
            rounds = api.rounds(study_id)
            finished = study.status in ("completed", "failed", "cancelled")
            for line in report.new_lines(rounds, finished):
                progress.console.print(line, soft_wrap=True, highlight=False)
            current = next((r for r in rounds if r.status in ("open", "aggregating")), None)
            detail = (
                f"round {current.number}: {len(current.updates)}/{len(current.participants)} reported"
                if current
                else ""
            )
            progress.update(bar, completed=min(study.completed_rounds, plan.rounds), detail=detail)
            if finished:
                return study
            time.sleep(1.0)


def _write_card(api: CardioflClient, study_id: int, path: Path) -> Path:
    """The study's model card as Markdown at `path` (`cardiofl study card`), its path printed."""
    path.write_text(api.card(study_id, "md"), encoding="utf-8")
    console.print(f"model card: {path}", soft_wrap=True)
    return path


def _admin_token() -> str:
    """A new bootstrap admin token for the demo's coordinator (its settings load SQLAlchemy: imported here)."""
    from coordinator.config import generate_admin_token

    return generate_admin_token()


def _print_round_tables(rounds: list[RoundPublic], algorithm: str) -> None:
    """Micro-F1 and mAP per round on each site's test split, as `cardiofl study show` prints them, and their note."""
    for table in round_tables(rounds):
        console.print(table)
    _print_lines(table_note(rounds, algorithm))


def _print_lines(lines: list[str]) -> None:
    """Each line as it is, however wide (a command in it stays one line to copy)."""
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False)


def run_demo(plan: DemoPlan, then: Callable[[CardioflClient, StudyPublic], None] | None = None) -> DemoResult:
    """Start everything, run the study, print the results; the final study and rounds.

    `then` is called with the client and the finished study while the coordinator still runs
    (to download its models, say).
    """
    plan.workdir.mkdir(parents=True, exist_ok=True)
    logs = plan.workdir / "logs"
    logs.mkdir(exist_ok=True)
    folders = _site_folders(plan)
    names = [f"site-{i + 1}" for i in range(len(folders))]
    port = plan.port or free_port()
    url = f"http://127.0.0.1:{port}"
    admin_token = _admin_token()
    if plan.database_url is None:  # one database per workdir: the previous run's goes, with its blob store
        for leftover in plan.workdir.glob("coordinator*.db*"):
            leftover.unlink()
        for leftover in plan.workdir.glob("coordinator*.blobs"):
            shutil.rmtree(leftover)
    database_url = plan.database_url or f"sqlite:///{(plan.workdir / 'coordinator.db').resolve()}"
    env = {
        **os.environ,
        "CARDIOFL_DATABASE_URL": database_url,
        "CARDIOFL_ADMIN_TOKEN": admin_token,
        "CARDIOFL_TICK_INTERVAL_S": "1",
    }
    agent_env = {k: v for k, v in os.environ.items() if not k.startswith("CARDIOFL_")}
    agent_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(folders)))

    with managed_processes() as processes, contextlib.closing(CardioflClient.connect(url, admin_token)) as api:

        def alive() -> None:
            processes.check_alive(logs)

        processes.start(
            "coordinator", [*_cardiofl(), "coordinator", "serve", "--port", str(port)], env, logs / "coordinator.log"
        )
        _wait_healthy(api, processes, logs)
        console.print(f"coordinator up at {url} ({database_url.split(':', 1)[0]})")
        for name, folder in zip(names, folders, strict=True):
            token_file = _write_site_token(plan, name, api.enrol_site(name).token.token)
            slowdown = plan.slowdown if name == slow_site(plan, names) else 1.0
            config = _write_site_config(plan, name, folder, url, token_file, slowdown=slowdown)
            processes.start(
                name, [*_cardiofl(), "site", "run", "--config", str(config)], agent_env, logs / f"{name}.log"
            )
        console.print(f"{len(names)} site agents started ({', '.join(names)}); logs in {logs}")
        if plan.secure:  # the terms name every site's signing key, registered at its agent's first poll
            _wait_registered(api, names, processes, logs)
        survey = survey_first(api, plan, names, alive, console)
        study = api.create_study(f"{title(plan)} demo", study_config(plan, names))
        api.study_action(study.id, "start")
        viewer = api.create_token("viewer", "demo dashboard").token
        dashboard = f"{url}/dashboard?study={study.id}#token={viewer}"
        console.print(f"dashboard (read-only): {dashboard}", soft_wrap=True)  # one line, whatever the width

        final = _follow(api, study.id, plan, processes, logs)
        rounds = api.rounds(study.id)
        external = external_validation(api, final, alive, console)
        console.print(f"study {final.id} {final.status}; per round on each site's test split:")
        _print_round_tables(rounds, plan.algorithm)
        card = _write_card(api, final.id, plan.workdir / "card.md")
        if then is not None:
            then(api, final)
        _keep_dashboard_up(plan.keep_running, dashboard)
        pids = [child.pid for _, child in processes.children]
        sites = dict(zip(names, folders, strict=True))
        result = DemoResult(
            study=final,
            rounds=rounds,
            dashboard=dashboard,
            pids=pids,
            url=url,
            sites=sites,
            card=card,
            survey=survey,
            external=external,
        )
    _print_lines(stopped_lines(None if plan.database_url else database_url, port, card))  # processes stopped
    return result


@demo_app.callback(invoke_without_command=True)
def demo(
    sites: Annotated[int, typer.Option(help="Synthetic sites (ignored with --data).")] = 4,
    rounds: Annotated[int, typer.Option(help="Communication rounds T.")] = 8,
    heads: Annotated[str, typer.Option(help="Head split H_g:H_l.")] = "6:2",
    preset: Annotated[str, typer.Option(help="Model preset (small runs on CPUs; paper needs a GPU).")] = "small",
    records: Annotated[int, typer.Option(help="Synthetic records per site.")] = 240,
    data: Annotated[
        list[Path] | None, typer.Option(help="A real site folder (Challenge or PTB-XL layout); repeat.")
    ] = None,
    optimizer: Annotated[str, typer.Option(help="Local optimizer: adam or sgd (FedCVD: sgd, lr 0.1).")] = "adam",
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-3,
    max_steps: Annotated[int | None, typer.Option(help="Cap on local steps per epoch.")] = None,
    seed: Annotated[int, typer.Option(help="Study seed.")] = 0,
    workdir: Annotated[Path, typer.Option(help="Where data, stores, logs and the database go.")] = Path(
        ".cardiofl/demo"
    ),
    database_url: Annotated[str | None, typer.Option(help="Coordinator database (default: SQLite in workdir).")] = None,
    keep_running: Annotated[
        bool, typer.Option(help="Keep the coordinator up after the study for the dashboard.")
    ] = False,
    min_records: Annotated[
        int, typer.Option(min=1, help="Sites send pooled statistics only from this many test records.")
    ] = 20,
    secure: Annotated[
        bool,
        typer.Option(
            help="Secure aggregation (the coordinator learns only the sum of the updates) and distributed DP."
        ),
    ] = False,
    noise_multiplier: Annotated[
        float, typer.Option(min=0, help="With --secure: DP noise multiplier z on the sum (0: no DP).")
    ] = 1.0,
    clip_norm: Annotated[
        float, typer.Option(help="With --secure: each site's update is clipped to this L2 norm.")
    ] = 0.1,
    survey: Annotated[bool, typer.Option(help="Run a data-readiness survey of the sites first.")] = True,
    validation_sites: Annotated[
        int, typer.Option(min=0, help="Hold the last N sites out of training to validate each released model.")
    ] = 1,
    buffered: Annotated[int, typer.Option(min=0, help="Buffered: a version per N updates, whoever sent them.")] = 0,
    slowdown: Annotated[float, typer.Option(min=1, help="The last training site trains this many times slower.")] = 1,
) -> None:
    """Start a coordinator and site agents on 127.0.0.1, run a FedDualAtt study, print per-round results."""
    sites_data = [[Path(part) for part in str(item).split(",") if part] for item in data or []]
    for folder in (folder for folders in sites_data for folder in folders):
        if not folder.is_dir():
            raise typer.BadParameter(f"{folder} is not a folder", param_hint="--data")
    plan = DemoPlan(
        workdir=workdir,
        sites=sites,
        rounds=rounds,
        heads=heads,
        preset=preset,
        records_per_site=records,
        data=sites_data,
        lr=lr,
        max_steps=max_steps,
        seed=seed,
        database_url=database_url,
        keep_running=keep_running,
        min_records=min_records,
        secure=secure,
        noise_multiplier=noise_multiplier,
        clip_norm=clip_norm,
        survey=survey,
        validation_sites=validation_sites,
        buffer_size=buffered,
        slowdown=slowdown,
    )
    try:
        result = run_demo(plan)
    except (ApiError, RuntimeError) as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("interrupted; every process the demo started was stopped")
        raise typer.Exit(130) from None
    if result.study.status != "completed":
        raise typer.Exit(1)
