"""Model files in a study's TOML: `[evaluation] model_file` and `initial_local_file`, keys of `cardiofl study create`.

An evaluate study may evaluate a model the researcher holds as two safetensors files (theta^g and phi_0)
instead of a completed study of this coordinator. The terms name such a model by its digests only:
`study create` reads each file named (a path relative to the TOML file), writes its sha256 into the terms
in the key's place (`model_sha256`, `initial_local_sha256`), checks the terms, then uploads the files
(POST /api/v1/models) before it creates the study. A file name never enters the terms.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cardiofl.client.http import ApiError, CardioflClient
from shared.study.checks import read_study_file
from shared.terms import StudyTerms, TermsError, read_terms_table

__all__ = ["FILE_KEYS", "StudyFile", "read_study_with_models", "upload_models"]

FILE_KEYS = {"model_file": "model_sha256", "initial_local_file": "initial_local_sha256"}  # file key -> digest key


@dataclass(frozen=True)
class StudyFile:
    """A study's TOML file as `cardiofl study create` sends it: its name, its checked terms, the models to upload."""

    name: str | None
    terms: StudyTerms
    models: dict[str, bytes]  # sha256 -> the bytes of each model file the terms name, uploaded first


def read_study_with_models(path: Path) -> StudyFile:
    """A study's TOML file read and checked with its model files' digests in place of their names; TermsError."""
    table = read_terms_table(path)
    evaluation = table.get("evaluation")
    models: dict[str, bytes] = {}
    if isinstance(evaluation, dict) and FILE_KEYS.keys() & evaluation.keys():
        table["evaluation"] = _with_digests(evaluation, path, models)
    name, terms = read_study_file(path, table)
    return StudyFile(name, terms, models)


def _with_digests(evaluation: dict[str, Any], path: Path, models: dict[str, bytes]) -> dict[str, Any]:
    """`[evaluation]` with each model file's key replaced by its digest's, the file's bytes added to `models`."""
    spec, problems = dict(evaluation), []
    for key, digest_key in FILE_KEYS.items():
        if key not in spec:
            continue
        named = spec.pop(key)
        if digest_key in spec:
            problems.append(f"evaluation.{key}: name the model by its file or by {digest_key}, not both")
            continue
        file = path.parent / str(named)
        try:
            data = file.read_bytes()
        except OSError as exc:
            problems.append(f"evaluation.{key}: cannot read {file}: {exc}")
            continue
        spec[digest_key] = hashlib.sha256(data).hexdigest()
        models[spec[digest_key]] = data
    if problems:
        raise TermsError(problems, str(path))
    return spec


def upload_models(client: CardioflClient, models: dict[str, bytes]) -> None:
    """POST each model to the coordinator, which must store it under the digest the terms name."""
    for digest, data in models.items():
        stored = client.upload_model(data)
        if stored != digest:
            raise ApiError(f"the coordinator stored the model file of sha256 {digest} as {stored}")
