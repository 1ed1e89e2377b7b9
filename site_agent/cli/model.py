"""`cardiofl site predict|evaluate|export`: a study's personal model put to work at the hospital."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from site_agent.cli.data import source_for

if TYPE_CHECKING:
    import httpx

    from site_agent.config import AgentSettings
    from site_agent.data.sources import Source
    from site_agent.device import Runtime
    from site_agent.predict import Evaluation, Predictions
    from site_agent.study_model import SiteModel

__all__ = ["config_flag", "evaluate_command", "export_command", "predict_command", "reported_errors", "site_http"]

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Site config file (TOML); CARDIOFL_SITE_* override it.")
]
StudyOption = Annotated[str, typer.Option("--study", help="Study id (or id-uid when the store holds two).")]
RoundOption = Annotated[
    int | None, typer.Option("--round", help="Use theta^g of this round (default: the newest, theta^g_T).")
]
StudyConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--study-config",
        help="The study's TOML (as given to `cardiofl study create`); needed for fedala and fedah, "
        "otherwise the model and algorithm are read from the tensors.",
    ),
]
RecordsOption = Annotated[
    Path, typer.Option("--records", help="A folder of WFDB records (Challenge or PTB-XL layout) or a manifest CSV.")
]
KindOption = Annotated[str, typer.Option(help="Layout of --records: auto, challenge, ptbxl or manifest.")]
LabelColumnOption = Annotated[
    list[str] | None, typer.Option(help="Manifest column(s) holding the labels (default: labels), e.g. dx.")
]
ResolutionOption = Annotated[str, typer.Option(help="PTB-XL records: hr (500 Hz) or lr (100 Hz).")]
BatchOption = Annotated[int, typer.Option(min=1, help="Records per forward pass.")]


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def config_flag(config: Path | None) -> str:
    """The ` --config PATH` a printed `cardiofl site ...` hint needs to run as this command did (none: the env)."""
    import shlex

    return f" --config {shlex.quote(str(config))}" if config is not None else ""


def site_http(settings: AgentSettings) -> httpx.Client:
    """An HTTP client of the coordinator with the site's token and TLS settings, as the agent's."""
    from site_agent.config import read_token
    from site_agent.tls import http_client

    return http_client(str(settings.coordinator_url), read_token(settings), settings.tls, timeout=60.0)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Settings (exit 2), store (3) and coordinator or study problems (1) as one line each."""
    from site_agent.data.sources import SourceError
    from site_agent.errors import AgentError, ConfigError
    from site_agent.store import StoreError

    try:
        yield
    except ConfigError as exc:
        _fail(str(exc), 2)
    except SourceError as exc:
        _fail(f"--records: {exc}", 2)
    except StoreError as exc:
        _fail(f"{exc}; nothing in the store was changed", 3)
    except AgentError as exc:
        _fail(str(exc), 1)


def _site_model(
    config: Path | None, study: str, round_: int | None, study_config: Path | None
) -> tuple[SiteModel, AgentSettings, Runtime]:
    """The site's settings and runtime, and its personal model of `study` (logs what was assembled)."""
    from site_agent.client import CoordinatorClient
    from site_agent.config import check_settings, configure_logging, load_settings, open_data, open_store
    from site_agent.device import resolve_runtime
    from site_agent.errors import ConfigError
    from site_agent.study_model import load_site_model, read_study_config

    settings = load_settings(config)
    configure_logging(settings)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    key = check_settings(settings)
    if not (settings.store_dir / "keycheck.enc").is_file():
        raise ConfigError(f"setting 'store_dir': no site store at {settings.store_dir}; this site has not trained yet")
    store = open_store(settings, key)
    runtime = resolve_runtime(settings.device, mixed_precision=settings.mixed_precision)
    parsed = read_study_config(study_config) if study_config is not None else None
    with site_http(settings) as http:
        client = CoordinatorClient(http, tls=settings.tls)
        site_model = load_site_model(
            client, store, settings.name, study, runtime, data=lambda: open_data(settings), round_=round_, config=parsed
        )
    logging.getLogger("site_agent").info("%s; on %s", site_model.describe(), runtime.describe())
    return site_model, settings, runtime


def _run(
    config: Path | None,
    study: str,
    round_: int | None,
    study_config: Path | None,
    source: Source,
    *,
    labelled: bool,
    batch_size: int,
) -> Predictions:
    from site_agent.data.scan import check_source
    from site_agent.predict import predict_source

    check_source(source)  # a wrong --records path fails before anything is downloaded
    site_model, settings, runtime = _site_model(config, study, round_, study_config)
    return predict_source(
        site_model.model, source, runtime, labelled=labelled, batch_size=batch_size, progress=settings.progress_bar
    )


def _records_line(predictions: Predictions) -> str:
    report = predictions.report
    skipped = f"skipped {report.n_skipped}" + (f" ({report.skip_summary()})" if report.n_skipped else "")
    return f"records: found {report.candidates}, used {len(predictions.record_ids)}, {skipped}"


def predict_command(
    records: RecordsOption,
    out: Annotated[Path, typer.Option("--out", "-o", help="CSV to write: one row per record.")],
    study: StudyOption,
    config: ConfigOption = None,
    round_: RoundOption = None,
    study_config: StudyConfigOption = None,
    kind: KindOption = "auto",
    label_column: LabelColumnOption = None,
    resolution: ResolutionOption = "hr",
    batch_size: BatchOption = 32,
) -> None:
    """Run the site's personal model of a study on WFDB records; write each record's 20 class probabilities."""
    from site_agent.predict import for_prediction, write_predictions

    source = for_prediction(source_for(records, kind, resolution, label_column))
    with reported_errors():
        predictions = _run(config, study, round_, study_config, source, labelled=False, batch_size=batch_size)
    write_predictions(out, predictions)
    typer.echo(f"wrote {len(predictions.record_ids)} predictions to {out}; {_records_line(predictions)}")


def _print_table(evaluation: Evaluation) -> None:
    from rich.console import Console

    from shared.evaluation.metrics import THRESHOLD
    from shared.tables import Table

    table = Table("class", "positives", "predicted", "F1", "AP", title=f"Per class (threshold {THRESHOLD})")
    for row in evaluation.classes:
        table.add_row(row.name, str(row.positives), str(row.predicted), f"{row.f1:.3f}", f"{row.ap:.3f}")
    Console().print(table)


def evaluate_command(
    records: RecordsOption,
    study: StudyOption,
    config: ConfigOption = None,
    round_: RoundOption = None,
    study_config: StudyConfigOption = None,
    kind: KindOption = "auto",
    label_column: LabelColumnOption = None,
    resolution: ResolutionOption = "hr",
    batch_size: BatchOption = 32,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Also write the predictions CSV here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """Run the site's personal model on labelled records; print micro-F1, mAP and a per-class table."""
    from site_agent.predict import evaluate_predictions, write_predictions

    source = source_for(records, kind, resolution, label_column)
    with reported_errors():
        predictions = _run(config, study, round_, study_config, source, labelled=True, batch_size=batch_size)
    if out is not None:
        write_predictions(out, predictions)
    if not predictions.record_ids:
        _fail(f"no record with a known class to evaluate on; {_records_line(predictions)}", 1)
    evaluation = evaluate_predictions(predictions)
    if as_json:
        typer.echo(json.dumps({**evaluation.to_dict(), "skipped": predictions.report.skipped}, indent=2))
        return
    _print_table(evaluation)
    typer.echo(
        f"micro-F1 {evaluation.micro_f1:.4f}, mAP {evaluation.map:.4f} "
        f"(present classes only {evaluation.map_present:.4f}) on {evaluation.n_records} records; "
        f"{_records_line(predictions)}"
    )


def export_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="The .pt2 file to write.")],
    study: StudyOption,
    config: ConfigOption = None,
    round_: RoundOption = None,
    study_config: StudyConfigOption = None,
) -> None:
    """Write the site's personal model as a torch.export file (.pt2) that runs with torch alone."""
    from shared.algorithms.learned_heads import LEARNED_SPLIT
    from shared.model.export import export_model, export_summary
    from shared.study.rules import algorithm_model
    from site_agent.data.records import STANDARD_LEADS

    with reported_errors():
        site_model, settings, _ = _site_model(config, study, round_, study_config)
    spec = site_model.spec
    learned = algorithm_model(spec.model, spec.algorithm).learned_heads
    description = {
        "model": "personal",
        "site": settings.name,
        "study": site_model.study.id,
        "study_uid": site_model.study.uid,
        "round": site_model.round,
        "global_sha256": site_model.global_sha256,
        "local_round": site_model.local_round,
        "preset": spec.model.preset,
        "heads": LEARNED_SPLIT if learned else spec.model.heads,
        "algorithm": spec.algorithm.name,
    }
    metadata = export_model(site_model.model, spec.model.config(), out, leads=STANDARD_LEADS, description=description)
    typer.echo(
        f"wrote {out}: the personal model of site {settings.name}, study {site_model.study.id} round "
        f"{site_model.round}; {export_summary(metadata)}"
    )
