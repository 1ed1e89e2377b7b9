"""A stored study's config and the tensor schema it implies, parsed once per distinct config and cached."""

from __future__ import annotations

import json
from functools import lru_cache

from coordinator.models import Study
from shared.partition import TensorSpec
from shared.protocol import StudyConfig
from shared.study import shared_schema, study_exchange

__all__ = ["exchange_schema", "study_config"]


def study_config(study: Study) -> StudyConfig:
    """The study's validated config."""
    return _parse(json.dumps(study.config, sort_keys=True))


@lru_cache(maxsize=256)
def _parse(config_json: str) -> StudyConfig:
    return StudyConfig.model_validate_json(config_json)


def exchange_schema(config: StudyConfig) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    """(shared schema every upload must match exactly, private names that must never arrive)."""
    return _schema(config.model_dump_json())


@lru_cache(maxsize=64)
def _schema(config_json: str) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    config = StudyConfig.model_validate_json(config_json)
    return shared_schema(config), study_exchange(config).local_names()  # phi_k and algorithm state
