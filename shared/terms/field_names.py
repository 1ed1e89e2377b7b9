"""A key that no field of a model has (a typo in a TOML file: `trainig`) and the field its writer meant."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, get_args

from pydantic import BaseModel

__all__ = ["did_you_mean"]


def did_you_mean(model: type[BaseModel], loc: Sequence[str | int]) -> str:
    """A suffix "; did you mean `training`?" for the unknown key at `loc` when a field of the model there is near."""
    current: type[BaseModel] | None = model
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list: the model the field's annotation holds
            continue
        field = current.model_fields.get(part) if current is not None else None
        current = _model_in(field.annotation) if field is not None else None
    if current is None or not loc or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(current.model_fields), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The first pydantic model in a type: itself, or inside Optional, Annotated, list ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
