"""A site takes a job only as the terms its operator approved ask it of this site; every other job is named wrong."""

from __future__ import annotations

from typing import Any

import pytest

from shared.study.accounting import trained_rounds
from shared.terms import StudyTerms
from shared.wire.jobs import JobKind, SiteJob, report_url
from shared.wire.protocol import PROTOCOL_VERSION
from shared.wire.urls import global_model_url, initial_local_url
from site_agent.job_check import job_problems

UID = "cd" * 16
MODEL, PHI = "a" * 64, "b" * 64


def train_terms(**changes: Any) -> StudyTerms:
    """A tiny training study of lyon and oslo, validated at rome every 2nd of its 5 rounds."""
    raw = {"sites": ["lyon", "oslo"], "validation_sites": ["rome"], "validation_every": 2, "rounds": 5}
    return StudyTerms.model_validate({**raw, "model": {"preset": "tiny"}, **changes})


def evaluate_terms() -> StudyTerms:
    """A tiny evaluate study at rome of a model named by its digests."""
    spec = {"study_uid": "e" * 32, "model_sha256": MODEL, "initial_local_sha256": PHI, "rounds": 5}
    return StudyTerms.model_validate(
        {"sites": ["rome"], "kind": "evaluate", "evaluation": spec, "model": {"preset": "tiny"}}
    )


def job(terms: StudyTerms, kind: JobKind, number: int = 0, **changes: Any) -> SiteJob:
    """The job an honest coordinator lists for rome."""
    downloads: dict[str, Any] = {}
    if kind is JobKind.EXTERNAL:
        downloads = {"model_url": global_model_url(7, number), "initial_local_url": initial_local_url(7)}
    elif kind is JobKind.EVALUATE:
        downloads = {"model_url": "/api/v1/studies/3/models/5", "initial_local_url": "/api/v1/studies/3/models/0/local"}
    if downloads:
        downloads |= {"model_sha256": MODEL, "initial_local_sha256": PHI}
    values = {
        "protocol": PROTOCOL_VERSION,
        "study_id": 7,
        "study_uid": UID,
        "site": "rome",
        "terms": terms,
        "kind": kind,
        "round": number,
        "report_url": report_url(7, kind, number),
        **downloads,
        **changes,
    }
    return SiteJob.model_validate(values)


def test_an_honest_job_of_each_kind_has_no_problem() -> None:
    survey = StudyTerms.model_validate({"sites": ["rome"], "kind": "survey", "model": {"preset": "tiny"}})
    assert job_problems(job(survey, JobKind.SURVEY), survey, "rome") == []
    assert job_problems(job(train_terms(), JobKind.EXTERNAL, 2), train_terms(), "rome") == []
    assert job_problems(job(evaluate_terms(), JobKind.EVALUATE), evaluate_terms(), "rome") == []


def test_a_training_site_is_no_validation_site() -> None:
    terms = train_terms()
    lyon = job(terms, JobKind.EXTERNAL, 2, site="lyon")
    assert job_problems(lyon, terms, "lyon") == ["the study's terms do not name 'lyon' among its validation sites"]
    assert job_problems(lyon, terms, "rome") == ["it is addressed to site 'lyon', not 'rome'"]


def test_a_job_of_another_kind_than_the_study_is_refused() -> None:
    terms = train_terms()
    assert job_problems(job(terms, JobKind.SURVEY), terms, "rome") == [
        "a survey job of a train study",
        "the study's terms do not list 'rome' among its sites",
    ]
    evaluation = evaluate_terms()
    assert job_problems(job(evaluation, JobKind.EXTERNAL, 2), evaluation, "rome")[:2] == [
        "an external validation of a evaluate study, which trains no model",
        "the study's terms do not name 'rome' among its validation sites",
    ]
    assert job_problems(job(terms, JobKind.EVALUATE), terms, "rome") == ["an evaluation job of a train study"]


def test_terms_other_than_the_approved_are_named() -> None:
    assert job_problems(job(train_terms(rounds=6), JobKind.EXTERNAL, 2), train_terms(), "rome") == [
        "its terms are not the ones this site's operator approved"
    ]


def test_an_evaluation_of_another_model_than_the_terms_name_is_refused() -> None:
    terms = evaluate_terms()
    other = job(terms, JobKind.EVALUATE, model_sha256="f" * 64, initial_local_sha256="0" * 64)
    assert job_problems(other, terms, "rome") == [
        f"the job's model digest {'f' * 12} is not the terms' {MODEL[:12]}",
        f"the job's phi_0 digest {'0' * 12} is not the terms' {PHI[:12]}",
    ]


def test_an_evaluation_of_a_model_file_is_checked_by_the_digests_the_terms_name() -> None:
    spec = {"model_sha256": MODEL, "initial_local_sha256": PHI}  # no study_uid: a model file
    terms = StudyTerms.model_validate(
        {"sites": ["rome"], "kind": "evaluate", "evaluation": spec, "model": {"preset": "tiny"}}
    )
    assert job_problems(job(terms, JobKind.EVALUATE), terms, "rome") == []
    other = job(terms, JobKind.EVALUATE, initial_local_sha256="0" * 64)
    assert job_problems(other, terms, "rome") == [f"the job's phi_0 digest {'0' * 12} is not the terms' {PHI[:12]}"]


def test_an_external_job_downloads_and_reports_at_the_studys_own_urls() -> None:
    terms = train_terms()
    moved = job(
        terms, JobKind.EXTERNAL, 2, model_url=global_model_url(8, 2), report_url=report_url(8, JobKind.EXTERNAL, 2)
    )
    assert job_problems(moved, terms, "rome") == [
        f"report_url is {report_url(8, JobKind.EXTERNAL, 2)!r}, not {report_url(7, JobKind.EXTERNAL, 2)!r}",
        f"its model is {global_model_url(8, 2)!r} (digest {MODEL!r}), not the study's {global_model_url(7, 2)!r}",
    ]


@pytest.mark.parametrize(
    ("number", "reported", "problem"),
    [
        (0, [], "round 0 is not a round the study can release (1 to 5)"),
        (6, [], "round 6 is not a round the study can release (1 to 5)"),
        (2, [], None),
        (5, [2, 4], None),  # the final round, not a multiple of 2
        (3, [2], None),  # off the schedule: the final round of a study that ended early
        (3, [3], None),  # the same round again (its report is sent again, never computed again)
        (
            3,
            [1],
            "round 3 is not a multiple of validation_every 2, and this site evaluated round 1 as the "
            "study's final one already",
        ),
        (4, [3], "round 4 comes after round 3, which this site evaluated as the final one"),
        (1, [2], "round 1 is off the schedule of every 2 rounds and not the last round evaluated here"),
    ],
)
def test_external_rounds_are_those_the_schedule_releases(number: int, reported: list[int], problem: str | None) -> None:
    terms = train_terms()
    problems = job_problems(job(terms, JobKind.EXTERNAL, number), terms, "rome", reported_rounds=reported)
    assert problems == ([problem] if problem else [])


def test_a_dp_budget_ends_the_rounds_a_validation_site_evaluates() -> None:
    dp = {"dp": {"noise_multiplier": 3.0, "clip_norm": 1.0, "epsilon_budget": 10.0}}
    terms = train_terms(rounds=50, validation_every=5, aggregation={"name": "equal"}, privacy=dp)
    last = trained_rounds(terms)
    assert last == 8  # the budget affords 8 of the 50 rounds; 8 is no multiple of 5
    assert job_problems(job(terms, JobKind.EXTERNAL, last), terms, "rome") == []  # the budget's final round
    assert job_problems(job(terms, JobKind.EXTERNAL, last + 1), terms, "rome") == [
        f"round {last + 1} is not a round the study can release (1 to {last})"
    ]
