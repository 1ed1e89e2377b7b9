"""`cardiofl site run|check|keygen|health|studies|approve|predict|...`: the commands a hospital's IT team runs."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from site_agent.cli.approvals import approve_command, decline_command, revoke_approval_command, studies_command
from site_agent.cli.model import evaluate_command, export_command, predict_command
from site_agent.cli.tls import tls_app
from site_agent.cli.ui import ui_command

if TYPE_CHECKING:  # the commands import what they use when they run: `cardiofl --help` stays quick
    import httpx

    from site_agent.config import AgentSettings
    from site_agent.device import Runtime
    from site_agent.store import SiteStore
    from site_agent.worker import SiteWorker

site_app = typer.Typer(help="Run a site agent and manage its local key.", no_args_is_help=True)
site_app.add_typer(tls_app, name="tls")

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Site config file (TOML); CARDIOFL_SITE_* override it.")
]


class StopRequested(BaseException):
    """SIGTERM or SIGINT arrived while the agent was starting or waiting on the network.

    Like KeyboardInterrupt it is no Exception, so no `except Exception` on its way (a log handler,
    a record reader) can swallow it.
    """


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@site_app.command("run")
def run_command(
    config: ConfigOption = None,
    max_rounds: Annotated[int | None, typer.Option(help="Stop after training this many rounds (demos, tests).")] = None,
) -> None:
    """Poll the coordinator, train on this site's data and upload only the study's shared tensors."""
    from site_agent.config import read_token
    from site_agent.device import resolve_runtime
    from site_agent.errors import ConfigError, UpgradeRequired
    from site_agent.loop import run
    from site_agent.memory import keep_model_buffers
    from site_agent.store import StoreError
    from site_agent.tls import http_client

    settings, store = _settings_and_store(config)
    keep_model_buffers()
    http = http_client(str(settings.coordinator_url), read_token(settings), settings.tls)
    stop = threading.Event()
    runtime = resolve_runtime(settings.device, mixed_precision=settings.mixed_precision, slowdown=settings.slowdown)
    worker: SiteWorker | None = None

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():  # a second signal (a process group's, an impatient operator's): already stopping
            return
        stop.set()
        logging.getLogger("site_agent").info("received %s; stopping", signal.Signals(signum).name)
        if worker is None or not worker.busy:  # opening the data or on a long poll: leave now; training
            raise StopRequested  # stops at its next step

    try:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        worker = _worker(settings, store, http, runtime, stop)
        run(
            worker,
            stop,
            poll_interval_s=settings.poll_interval_s,
            max_backoff_s=settings.max_backoff_s,
            heartbeat=settings.heartbeat_file,
            max_rounds=max_rounds,
        )
    except StopRequested:
        pass
    except ConfigError as exc:  # a data source cannot be read, or the token is another site's or refused (401)
        _fail(str(exc), 2)
    except StoreError as exc:
        _fail(f"{exc}; the agent stops and leaves every store file as it is", 3)
    except UpgradeRequired as exc:
        _fail(str(exc), 4)
    finally:
        http.close()  # no signal raises any more: stop is set
        for signum in (signal.SIGTERM, signal.SIGINT):  # stopped: a later signal must not kill the exit
            signal.signal(signum, signal.SIG_IGN)
    logging.getLogger("site_agent").info("stopped")


def _settings_and_store(config: Path | None) -> tuple[AgentSettings, SiteStore]:
    """The site's settings (logging configured by them) and its opened store; exit 2 or 3 when either is wrong."""
    from site_agent.config import check_settings, configure_logging, load_settings, open_store
    from site_agent.errors import ConfigError
    from site_agent.store import StoreError

    try:
        settings = load_settings(config)
        configure_logging(settings)
        key = check_settings(settings)
        return settings, open_store(settings, key)  # StaleStore: an older copy of the store was restored
    except ConfigError as exc:
        _fail(str(exc), 2)
    except StoreError as exc:
        _fail(f"{exc}; the agent stops and leaves every store file as it is", 3)
    raise AssertionError("unreachable: _fail exits")


def _worker(
    settings: AgentSettings, store: SiteStore, http: httpx.Client, runtime: Runtime, stop: threading.Event
) -> SiteWorker:
    """The site's worker over its data, opened now: a source that cannot be read stops the agent before any poll."""
    from site_agent.client import CoordinatorClient
    from site_agent.config import open_data, site_command
    from site_agent.kept_partials import kept_partials_dir
    from site_agent.worker import SiteWorker

    site_data = open_data(settings)
    kept = kept_partials_dir(settings.store_dir)  # a download cut by a restart resumes where it stopped
    worker = SiteWorker(
        site=settings.name,
        client=CoordinatorClient(http, poll_wait_s=settings.poll_wait_s, tls=settings.tls, download_dir=kept),
        store=store,
        data=lambda: site_data,
        runtime=runtime,
        progress_bar=settings.progress_bar,
        stop=stop,
        auto_approve=settings.auto_approve,
        sources=settings.data,  # what a survey study's job counts: the very sources the agent trains on
        studies_command=site_command(settings, "studies"),
    )
    log = logging.getLogger("site_agent")
    if settings.auto_approve:
        log.warning(
            "auto_approve is on: this agent trains for every study that lists this site, unreviewed "
            "(demos and tests only; a hospital approves each study with `cardiofl site approve`)"
        )
    log.info("site %s polling %s on %s", settings.name, settings.coordinator_url, runtime.describe())
    return worker


@site_app.command("check")
def check_command(
    config: ConfigOption = None,
    preset: Annotated[str, typer.Option(help="Model preset of the timed training step.")] = "small",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Check that this site is ready (settings, store, TLS, data, coordinator, device); exit 0 only if so."""
    import json

    from rich.console import Console

    from site_agent.preflight import Preflight, is_ready, render, run_checks
    from site_agent.preflight import as_json as report_json

    results = run_checks(Preflight(config, preset=preset))
    if as_json:
        typer.echo(json.dumps(report_json(results), indent=2))
    else:
        render(results, Console())
    raise typer.Exit(0 if is_ready(results) else 1)


@site_app.command("keygen")
def keygen_command(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Where to write the key file (mode 600, never overwritten).")
    ],
) -> None:
    """Create a new AES-256 key file for the encrypted local store."""
    from site_agent.store import write_key_file

    try:
        write_key_file(out)
    except FileExistsError:
        _fail(f"{out} already exists; refusing to overwrite a store key", 1)
    typer.echo(f"wrote a new store key to {out} (mode 600). Back it up: without it the store cannot be read.")


@site_app.command("health")
def health_command(
    config: ConfigOption = None,
    max_age: Annotated[
        float | None,
        typer.Option(
            help="Seconds since the last heartbeat after which the agent is stuck "
            "(default: 3 x (poll_wait_s + poll_interval_s), at least 30)."
        ),
    ] = None,
) -> None:
    """Exit 0 when the agent polled recently (container health checks)."""
    from site_agent.config import health_limit, load_settings
    from site_agent.errors import ConfigError

    try:
        settings = load_settings(config)
    except ConfigError as exc:
        _fail(str(exc), 2)
    if settings.heartbeat_file is None:
        _fail("setting 'heartbeat_file' is not set; nothing to check", 2)
    try:
        age = time.time() - float(settings.heartbeat_file.read_text().strip())
    except (OSError, ValueError):
        _fail(f"no heartbeat in {settings.heartbeat_file} yet", 1)
    if max_age is None:
        max_age = health_limit(settings)
    if age > max_age:
        _fail(f"last poll {age:.0f}s ago (more than {max_age:.0f}s)", 1)
    typer.echo(f"ok: last poll {age:.0f}s ago")


# The operator decides which studies run on the site's data (site_agent/cli/approvals.py).
site_app.command("studies")(studies_command)
site_app.command("approve")(approve_command)
site_app.command("decline")(decline_command)
site_app.command("revoke-approval")(revoke_approval_command)
site_app.command("ui")(ui_command)  # the same, in a page on 127.0.0.1 (site_agent/cli/ui.py)

# Using a study's model at the site (site_agent/cli/model.py).
site_app.command("predict")(predict_command)
site_app.command("evaluate")(evaluate_command)
site_app.command("export")(export_command)
