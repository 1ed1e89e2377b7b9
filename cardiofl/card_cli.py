"""`cardiofl study card`: a study's model card as Markdown, HTML or JSON, printed or written to a file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from cardiofl.client.cli import DEFAULT_URL, TokenOption, UrlOption, connected, study_app

__all__ = ["study_card"]

Format = Literal["md", "html", "json"]


@study_app.command("card")
def study_card(
    study_id: Annotated[int, typer.Argument(help="Study id.")],
    card_format: Annotated[
        Format, typer.Option("--format", help="md (Markdown), html (one self-contained page) or json (a ModelCard).")
    ] = "md",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the card to this file instead.")] = None,
    baseline: Annotated[
        int | None, typer.Option(help="A study of algorithm `local` on the same sites to compare each site with.")
    ] = None,
    survey: Annotated[
        int | None,
        typer.Option(help="A survey study of its training sites for the Data section (default: the newest of them)."),
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """The study's model card: terms, approvals, data, figures, external validation, epsilon, digests, limitations."""
    with connected(url, token) as client:
        if card_format == "json":
            text = client.card(study_id, baseline=baseline, survey=survey).model_dump_json(indent=2) + "\n"
        else:
            text = client.card(study_id, card_format, baseline=baseline, survey=survey)
    if out is None:
        typer.echo(text, nl=False)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote the model card of study {study_id} to {out}")
