"""The parts of a study's terms that say what kind of study it is: a survey's release, an evaluation's model.

`StudyTerms.kind` (shared/terms/study_terms.py) is `train`, `survey` or `evaluate`; a survey's terms may
carry `SurveySpec`, an evaluation's must carry `EvaluationSpec`. `Terms` is the base of every part.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["EvaluationSpec", "Sha256", "StudyKind", "SurveySpec", "Terms"]

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
StudyKind = Literal["train", "survey", "evaluate"]  # what a study does at its sites (StudyTerms.kind)


class Terms(BaseModel):
    """A part of the terms: unknown keys and NaN/Inf are refused, nothing changes once made."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SurveySpec(Terms):
    """A survey study's release (shared/wire/survey_release.py): suppressed below min_records, optionally noised.

    `noise_sigma` puts discrete Gaussian noise N_Z(0, sigma^2) on every count before suppression; its
    epsilon at `delta` is shared/study/survey.py's `survey_epsilon`, which the site's operator approves.
    """

    noise_sigma: float | None = Field(None, gt=0, le=1e6)
    delta: float = Field(1e-6, gt=0, lt=1)


class EvaluationSpec(Terms):
    """What an `evaluate` study evaluates: a completed study's final model, or a model file, named by its digests.

    Exactly one source. `study_uid`: the coordinator fills in `model_sha256` (theta^g_T),
    `initial_local_sha256` (phi_0) and `rounds` (T) from that study when the study is created. Or, without
    it, both digests of a model file the researcher uploaded (POST /api/v1/models), whose tensors must be
    those of the terms' own model and algorithm; it has no `rounds`. Either way each site's approval covers
    the very model; the site checks the bytes it downloads against the digests. `adapt_local_epochs` E > 0:
    the site first trains only its local tensors (phi) on its training split for E epochs (nothing
    leaves), and reports the model before and after.
    """

    study_uid: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")  # None: a model file, named by its digests
    model_sha256: Sha256 | None = None
    initial_local_sha256: Sha256 | None = None
    rounds: int | None = Field(None, ge=1)  # T of the evaluated study: its final model is theta^g_T
    adapt_local_epochs: int = Field(0, ge=0, le=1_000)

    @model_validator(mode="after")
    def _one_source(self) -> EvaluationSpec:
        if self.study_uid is not None:
            return self
        missing = [name for name in ("model_sha256", "initial_local_sha256") if getattr(self, name) is None]
        if missing:
            raise PydanticCustomError(
                "terms",
                "name the evaluated model by study_uid (a completed study's final model), or by both model_sha256 "
                "and initial_local_sha256 (a model file); missing {missing}",
                {"missing": " and ".join(missing)},
            )
        if self.rounds is not None:
            raise PydanticCustomError("terms", "rounds is T of an evaluated study; a model file has none")
        return self
