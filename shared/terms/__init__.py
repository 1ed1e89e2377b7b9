"""A study's terms as data: `StudyTerms` and its parts (study_terms), the model presets they name (model_config).

The types check what a field alone can check and import nothing above the wire; the rules that need the
algorithm registry, privacy accounting or secure-aggregation setup live in shared/study/checks.py.
"""

from shared.terms.buffered import BufferedSpec, Staleness
from shared.terms.study_terms import (
    AggregationSpec,
    AlgorithmSpec,
    DifferentialPrivacy,
    EvaluationSpec,
    ModelSpec,
    ParticipationSpec,
    PrivacyConfig,
    SecureAggregation,
    SiteName,
    StudyKind,
    StudyTerms,
    SurveySpec,
    TermsError,
    TrainingConfig,
    read_terms_file,
    read_terms_table,
    terms_from,
    terms_of_table,
    terms_problems,
)

__all__ = [
    "AggregationSpec",
    "BufferedSpec",
    "Staleness",
    "AlgorithmSpec",
    "DifferentialPrivacy",
    "EvaluationSpec",
    "ModelSpec",
    "ParticipationSpec",
    "PrivacyConfig",
    "SecureAggregation",
    "SiteName",
    "StudyKind",
    "StudyTerms",
    "SurveySpec",
    "TermsError",
    "TrainingConfig",
    "read_terms_file",
    "read_terms_table",
    "terms_from",
    "terms_of_table",
    "terms_problems",
]
