"""`cardiofl study survey`: a survey study's released surveys, per site and pooled, with what their marks mean."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from cardiofl.client.cli import (
    DEFAULT_URL,
    JsonOption,
    TokenOption,
    UrlOption,
    _print_json,
    connected,
    console,
    study_app,
)
from cardiofl.client.job_figures import GROUPS, survey_legend, survey_table

__all__ = ["study_survey"]


class Group(StrEnum):
    """A group of a site's records in its survey."""

    TRAIN = "train"
    TEST = "test"
    EXCLUDED = "excluded"


@study_app.command("survey")
def study_survey(
    study_id: Annotated[int, typer.Argument(help="Study id (a study of kind survey).")],
    groups: Annotated[
        list[Group] | None,
        typer.Option("--group", help="Pool only these groups (repeat it: --group train --group test); default all."),
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """A survey study's tables: each key per site and pooled over the sites, the legend, and the sites awaited."""
    with connected(url, token) as client:
        results = client.survey(study_id)
    if as_json:
        _print_json(results)
        return
    chosen = [
        group for group in GROUPS if group in {g.value for g in groups or Group}
    ]  # in the vocabulary's order, once each
    if results.sites:
        console.print(survey_table(results, chosen))
    else:
        console.print(f"no site of study {study_id} has reported its survey yet")
    for line in survey_legend(results, chosen):
        console.print(line, highlight=False)
