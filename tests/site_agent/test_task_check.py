"""A site recomputes every fact of a task from the terms it approved; each fact a coordinator alters is named."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from shared.study.round_terms import load_factor, secure_round_info
from shared.study.rules import select_participants
from shared.terms import StudyTerms
from shared.wire.protocol import PROTOCOL_VERSION, TaskSpec
from shared.wire.secure import SecureRoundView
from shared.wire.urls import decline_url, global_model_url, initial_local_url, update_url
from site_agent.errors import TaskMismatch
from site_agent.task_check import check_round_view, check_task

UID = "ab" * 16
SITES = ["lyon", "oslo", "rome", "turin"]


def terms(**changes: Any) -> StudyTerms:
    """A tiny-model study's terms over SITES."""
    return StudyTerms.model_validate({"sites": SITES, "model": {"preset": "tiny"}, "rounds": 3, **changes})


SECURE = {"min_sites": 3, "privacy": {"secure_aggregation": {}}}


def honest(study: StudyTerms, *, site: str = "oslo", number: int = 1, attempt: int = 1, **facts: Any) -> TaskSpec:
    """The task the coordinator writes (coordinator/rounds/tasks.py does the same with the same functions)."""
    kind = "evaluate" if number == study.rounds + 1 else "train"
    chosen = sorted(study.sites) if kind == "evaluate" else sorted(select_participants(study, number, attempt))
    secure = None
    if study.privacy.secure_aggregation is not None:
        secure = secure_round_info(
            study, study_uid=UID, number=number, attempt=attempt, participants=chosen, site=site, round_id=40
        )
    task = {
        "protocol": PROTOCOL_VERSION,
        "study_id": 7,
        "study_uid": UID,
        "site": site,
        "terms": study,
        "round_id": 40,
        "round": number,
        "attempt": attempt,
        "kind": kind,
        "participants": chosen,
        "load_factor": load_factor(study, chosen),
        "global_model_round": number - 1,
        "global_model_sha256": "0" * 64,
        "global_model_url": global_model_url(7, number - 1),
        "initial_local_sha256": "1" * 64,
        "initial_local_url": initial_local_url(7),
        "update_url": update_url(40),
        "decline_url": decline_url(40),
        "deadline": datetime(2026, 12, 1, tzinfo=UTC),
        "secure": secure,
    }
    return TaskSpec.model_validate({**task, **facts})


def altered(task: TaskSpec, **changes: Any) -> TaskSpec:
    """The task with some of its JSON replaced."""
    return TaskSpec.model_validate({**task.model_dump(mode="json"), **changes})


def refused(task: TaskSpec, approved: StudyTerms, match: str) -> None:
    with pytest.raises(TaskMismatch, match=match):
        check_task(task, approved, "oslo")


def test_an_honest_task_gives_the_round_the_terms_make() -> None:
    study = terms(participation={"name": "random", "params": {"p": 0.5}}, min_sites=2)
    site = sorted(select_participants(study, 2, 2))[0]
    task = honest(study, site=site, number=2, attempt=2)
    spec = check_task(task, study, site)
    assert (spec.terms, spec.site, spec.round) == (study, site, 2)
    assert spec.load_factor == len(SITES) / len(task.participants) and spec.quorum == 2
    final = check_task(honest(study, number=4), study, "oslo")
    assert (final.load_factor, final.round) == (1.0, 4)


def test_other_terms_are_refused() -> None:
    study = terms()
    task = honest(study)
    refused(altered(task, terms={**task.terms.model_dump(mode="json"), "seed": 3}), study, "not the ones")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"site": "rome"}, "addressed to site 'rome'"),
        ({"kind": "evaluate"}, "is a train round"),
        ({"round": 9, "global_model_round": 8, "global_model_url": global_model_url(7, 8)}, "past the study's end"),
        ({"attempt": 4}, "beyond the 2 retries"),
        ({"global_model_round": 3}, "trains from theta"),
        ({"participants": ["lyon", "rome", "turin"]}, "do not name this site"),
        ({"participants": ["lyon", "oslo", "paris"]}, "outside the study's terms"),
        ({"participants": ["lyon", "oslo"]}, "picks"),
        ({"load_factor": 2.0}, "load factor 2.0"),
        ({"global_model_url": global_model_url(8, 0)}, "global_model_url"),
        ({"initial_local_url": initial_local_url(8)}, "initial_local_url"),
        ({"update_url": update_url(41)}, "update_url"),
        ({"decline_url": decline_url(41)}, "decline_url"),
    ],
)
def test_each_round_fact_is_recomputed(changes: dict[str, Any], match: str) -> None:
    study = terms()
    refused(altered(honest(study), **changes), study, match)


def test_the_final_evaluation_asks_every_site() -> None:
    study = terms(participation={"name": "random", "params": {"p": 0.5}}, min_sites=2)
    task = honest(study, number=4)
    refused(altered(task, participants=["lyon", "oslo"], load_factor=2.0), study, "asks every site")


def test_a_pick_that_depends_on_round_times_is_bounded_in_size() -> None:
    study = terms(participation={"name": "fast_on_odd", "params": {"f": 0.5}}, min_sites=1)
    for chosen in (["lyon", "oslo"], ["lyon", "oslo", "rome"], SITES):  # odd round: 4 - 2 to 4 sites
        check_task(honest(study, participants=chosen, load_factor=load_factor(study, chosen)), study, "oslo")
    refused(honest(study, participants=["oslo"], load_factor=4.0), study, "picks 2 to 4")
    even = honest(study, number=2)
    refused(altered(even, participants=["lyon", "oslo"], load_factor=2.0), study, "picks 4 to 4")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("threshold", 1),
        ("neighbour_count", 1),
        ("min_survivors", 2),
        ("fraction_bits", 8),
        ("ring_bits", 64),
        ("graph_seed", "f" * 64),
        ("site_number", 1),
        ("sites", {"lyon": 2, "oslo": 1, "rome": 3, "turin": 4}),
        ("url", "/api/v1/rounds/41/secagg"),
    ],
)
def test_a_secure_setup_other_than_the_terms_make_is_refused(field: str, value: Any) -> None:
    study = terms(**SECURE)
    task = honest(study)
    assert task.secure is not None
    refused(altered(task, secure={**task.secure.model_dump(mode="json"), field: value}), study, f"secure.{field}")


def test_secure_terms_with_a_plain_task_and_plain_terms_with_a_secure_task_are_refused() -> None:
    secure = terms(**SECURE)
    refused(altered(honest(secure), secure=None), secure, "terms ask for secure aggregation")
    plain = terms(min_sites=3)
    smuggled = honest(secure).secure
    assert smuggled is not None
    refused(altered(honest(plain), secure=smuggled.model_dump(mode="json")), plain, "ask for no secure aggregation")


def test_the_secure_setup_follows_round_and_attempt_not_the_coordinators_row() -> None:
    study = terms(**SECURE)
    first, retry = honest(study), honest(study, attempt=2)
    assert first.secure is not None and retry.secure is not None
    assert first.secure.graph_seed != retry.secure.graph_seed  # a retry is a new graph and new keys
    refused(altered(retry, secure=first.secure.model_dump(mode="json")), study, "secure.graph_seed")


def test_a_round_view_of_another_round_is_refused() -> None:
    view = SecureRoundView(round_id=40, status="open", phase=2, deadline=None)
    check_round_view(view, 40)
    with pytest.raises(TaskMismatch, match="of round 41"):
        check_round_view(view.model_copy(update={"round_id": 41}), 40)


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_no_task_of_a_round_the_site_revealed_in_is_taken_whatever_attempt_it_names(attempt: int) -> None:
    study = terms(**SECURE)
    task = honest(study, attempt=attempt)
    assert check_task(task, study, "oslo", revealed=None).round == 1
    with pytest.raises(TaskMismatch, match="revealed its shares in attempt 1 of round 1"):
        check_task(task, study, "oslo", revealed=1)
    plain = terms()
    assert check_task(honest(plain, attempt=attempt), plain, "oslo", revealed=1).round == 1  # only secure rounds


@pytest.mark.parametrize("attempt", [1, 2])
def test_a_secure_task_from_a_model_another_round_used_is_refused_its_retry_is_not(attempt: int) -> None:
    study = terms(**SECURE)
    task = honest(study, number=2, attempt=attempt)
    own = f"7-{UID}"
    assert check_task(task, study, "oslo", used=None).round == 2
    assert check_task(task, study, "oslo", used=(own, 2)).round == 2  # this very round again: an honest retry
    for used in [(own, 1), (own, 3), (f"8-{'cd' * 16}", 2)]:  # another round of it, another study
        with pytest.raises(
            TaskMismatch, match=rf"from theta\^g 000000000000 before \(round {used[1]} of study {used[0]}\)"
        ):
            check_task(task, study, "oslo", used=used)
    plain = terms()
    assert check_task(honest(plain, number=2), plain, "oslo", used=(own, 1)).round == 2  # only secure rounds


@pytest.mark.parametrize("buffered", [None, {"buffer_size": 2}])
def test_versions_only_increase_the_same_round_only_as_its_retry(buffered: dict[str, Any] | None) -> None:
    study = terms(buffered=buffered, min_sites=2)
    with pytest.raises(TaskMismatch, match="after round 3, whose update this site had accepted: versions only"):
        check_task(honest(study, number=2), study, "oslo", trained=3)
    assert check_task(honest(study, number=3, attempt=2), study, "oslo", trained=3).round == 3  # a retry
    assert check_task(honest(study, number=4), study, "oslo", trained=3).round == 4  # the final evaluation
    assert check_task(honest(study, number=1), study, "oslo", trained=None).round == 1
