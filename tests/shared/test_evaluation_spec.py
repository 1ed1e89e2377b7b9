"""An evaluate study's model: a completed study's (`study_uid`) or a model file's (both digests, no study)."""

from __future__ import annotations

from typing import Any

import pytest

from shared.study.description import describe
from shared.terms import StudyTerms, TermsError, terms_from
from shared.wire.card import terms_digest

MODEL, PHI, UID = "a" * 64, "b" * 64, "e" * 32


def evaluate_terms(**evaluation: Any) -> StudyTerms:
    """A tiny evaluate study at rome of the model `evaluation` names."""
    return terms_from({"sites": ["rome"], "kind": "evaluate", "evaluation": evaluation, "model": {"preset": "tiny"}})


def test_the_terms_of_a_completed_studys_model_dump_and_digest_as_before_model_files() -> None:
    terms = evaluate_terms(study_uid=UID, model_sha256=MODEL, initial_local_sha256=PHI, rounds=5, adapt_local_epochs=1)
    assert terms.model_dump(mode="json")["evaluation"] == {
        "study_uid": UID,
        "model_sha256": MODEL,
        "initial_local_sha256": PHI,
        "rounds": 5,
        "adapt_local_epochs": 1,
    }
    # both digests were computed by the release before evaluations of model files: a site's approval holds
    assert terms_digest(terms) == "36ef3af600229c826f5f4920b1eab6da68a31932d76efab02972976b4303908d"
    description = describe(terms, study_uid="u" * 32, site="rome", protocol=5)
    assert description.digest() == "0388e76bbc3e8f27dcb4d149a3590451aee6c6c42d55b02cb0db62206cac55b5"
    assert description.statistics[0] == (
        f"nothing is trained for others and no tensor leaves: the site downloads the final model of study {UID} "
        f"(theta^g {MODEL[:12]}, phi_0 {PHI[:12]})"
    )


def test_a_model_file_is_named_by_both_digests_without_a_study_and_described_as_uploaded() -> None:
    terms = evaluate_terms(model_sha256=MODEL, initial_local_sha256=PHI)
    assert terms.evaluation is not None
    assert terms.evaluation.model_dump() == {
        "study_uid": None,
        "model_sha256": MODEL,
        "initial_local_sha256": PHI,
        "rounds": None,
        "adapt_local_epochs": 0,
    }
    assert terms_from(terms.model_dump(mode="json")) == terms  # as the coordinator stores and sites read them
    statistics = describe(terms, study_uid="u" * 32, site="rome", protocol=5).statistics
    assert statistics[0] == (
        "nothing is trained for others and no tensor leaves: the site downloads the model whose digests the terms "
        f"name, uploaded by the researcher (theta^g {MODEL[:12]}, phi_0 {PHI[:12]})"
    )


SOURCES = (
    "evaluation: name the evaluated model by study_uid (a completed study's final model), or by both model_sha256 "
    "and initial_local_sha256 (a model file); missing "
)


@pytest.mark.parametrize(
    ("evaluation", "problem"),
    [
        ({}, SOURCES + "model_sha256 and initial_local_sha256"),
        ({"model_sha256": MODEL, "adapt_local_epochs": 1}, SOURCES + "initial_local_sha256"),
        ({"initial_local_sha256": PHI}, SOURCES + "model_sha256"),
        (
            {"model_sha256": MODEL, "initial_local_sha256": PHI, "rounds": 3},
            "evaluation: rounds is T of an evaluated study; a model file has none",
        ),
        (
            {"study_uid": UID, "model_file": "theta.safetensors"},
            "evaluation.model_file: Extra inputs are not permitted",
        ),
    ],
    ids=["nothing", "no phi_0", "no theta", "rounds of a file", "a file name"],
)
def test_an_evaluation_names_exactly_one_source_and_never_a_file(evaluation: dict[str, Any], problem: str) -> None:
    with pytest.raises(TermsError) as refused:
        evaluate_terms(**evaluation)
    assert refused.value.problems == [problem]
