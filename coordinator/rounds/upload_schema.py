"""The tensor schema a study's terms imply for its uploads, derived once per distinct terms and cached."""

from __future__ import annotations

from functools import lru_cache

from shared.study.rules import shared_schema, study_exchange
from shared.tensors.codec import TensorSpec
from shared.terms import StudyTerms

__all__ = ["exchange_schema"]


def exchange_schema(terms: StudyTerms) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    """(shared schema every upload must match exactly, private names that must never arrive)."""
    return _schema(terms.model_dump_json())


@lru_cache(maxsize=64)
def _schema(terms_json: str) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    terms = StudyTerms.model_validate_json(terms_json)
    return shared_schema(terms), study_exchange(terms).local_names()  # phi_k and algorithm state
