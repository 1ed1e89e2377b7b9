"""`cardiofl study track`: a study's record to MLflow and TensorBoard as it runs (cardiofl/tracking.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cardiofl.client.cli import DEFAULT_URL, TokenOption, UrlOption, WaitOption, connected, study_app

__all__ = ["MlflowOption", "TensorBoardOption", "track"]

MlflowOption = Annotated[
    str | None, typer.Option(help="MLflow tracking URI, e.g. sqlite:///mlflow.db (extra: cardiofl[mlflow]).")
]
TensorBoardOption = Annotated[
    Path | None, typer.Option(help="TensorBoard log directory (extra: cardiofl[tensorboard]).")
]


@study_app.command("track")
def track(
    study_id: Annotated[int, typer.Argument(help="Study id.")],
    mlflow: MlflowOption = None,
    experiment: Annotated[str, typer.Option(help="MLflow experiment (created when new).")] = "cardiofl",
    tensorboard: TensorBoardOption = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    wait: WaitOption = 30.0,
) -> None:
    """Log a study's terms, per-round metrics, epsilon and last theta^g to MLflow and/or TensorBoard as it runs."""
    from cardiofl.tracking import open_trackers, track_study

    if mlflow is None and tensorboard is None:
        raise typer.BadParameter("give --mlflow URI, --tensorboard DIR or both")
    with connected(url, token) as client:
        name = f"study {study_id}: {client.study(study_id).name}"
        trackers = open_trackers(mlflow, experiment, name, tensorboard / f"study{study_id}" if tensorboard else None)
        logged = track_study(client, study_id, trackers, wait=wait)
        typer.echo(f"study {study_id} {client.study(study_id).status}: {logged} round attempt(s) tracked")
