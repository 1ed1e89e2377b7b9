"""`cardiofl study download`: theta^g of a round into a file, resumable and checked against the listing's sha256."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from cardiofl.client.http import ApiError, CardioflClient
from cardiofl.client.resumable_download import RETRIES, Downloaded, FileDownload
from shared.wire.api import GlobalModelPublic
from shared.wire.urls import global_model_url

__all__ = ["chosen_model", "download_global_model"]


def chosen_model(models: list[GlobalModelPublic], study_id: int, round_number: int | None) -> GlobalModelPublic:
    """The model of round `round_number` (None: the latest) among a study's; ApiError when it has none."""
    if round_number is None:
        if not models:
            raise ApiError(f"study {study_id} has no global model yet")
        return max(models, key=lambda m: m.round)
    for model in models:
        if model.round == round_number:
            return model
    raise ApiError(f"study {study_id} has no global model of round {round_number}")


def download_global_model(
    client: CardioflClient, study_id: int, round_number: int | None, out: Path, *, retries: int = RETRIES
) -> tuple[GlobalModelPublic, Downloaded]:
    """theta^g of a round (None: the latest) written to `out` once its sha256 is the one the models listing gives.

    The bytes go to `<out>.part` as they arrive, so a cut download resumes (resumable_download.py).
    A bar on stderr shows the transfer when stderr is a terminal; a resumption or restart is one line there.
    """
    model = chosen_model(client.global_models(study_id), study_id, round_number)
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    ) as progress:
        bar = progress.add_task(f"theta^g round {model.round}", total=model.size)
        download = FileDownload(
            client.http,
            global_model_url(study_id, model.round),
            out,
            sha256=model.sha256,
            retries=retries,
            on_progress=lambda held, size: progress.update(bar, completed=held, total=size if size >= 0 else None),
            notify=lambda line: progress.console.print(line, markup=False, highlight=False, soft_wrap=True),
        )
        return model, download.run()
