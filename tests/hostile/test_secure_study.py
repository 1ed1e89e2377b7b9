"""A hostile coordinator against real site agents, secure study: each secure-setup fact altered alone is declined.

The same four real agents and real coordinator as tests/hostile/test_plain_study.py (SQLite and
PostgreSQL), on a study under secure aggregation (SecAgg+: 4 sites, min_sites 3, min_records 1 so
the sites' counts and histograms exist and must travel under the masks only). The victim, oslo,
reaches the coordinator through a HostileTransport that rewrites one thing in the first task it
receives, or in the secure round's view it reads after it advertised honestly.

A declined task: the victim POSTs the decline (reason naming the field), sends nothing else (no
advertisement, shares, update or reveal: nothing in the clear), downloads nothing, the audit holds
`task.declined`, its next poll gets nothing, and the other three finish the secure round without it
(theta^g_1 is released). A round view altered mid-round: the victim had advertised, then declines
and sends no later-phase message; the other three finish the round without it.

Derived setup of round 1 for 4 participants: site numbers 1..4 (oslo 2), neighbour_count 3,
threshold 2, min_survivors 3, fraction_bits 24, graph seed from (study uid, round, attempt).

| alteration (victim only)                       | outcome                                                      |
| ---------------------------------------------- | ------------------------------------------------------------ |
| none (identity on tasks and views)             | all four finish the round, theta^g_1 exists, no decline      |
| task.secure -> null                            | declined: "the terms ask for secure aggregation and ..."     |
| task.secure.threshold -> 1                     | declined: "secure.threshold is 1; the terms make it 2"       |
| task.secure.threshold -> derived + 1           | declined: "secure.threshold is 3; ..."                       |
| task.secure.neighbour_count -> derived - 1     | declined: "secure.neighbour_count is 2; ..."                 |
| task.secure.fraction_bits -> 16                | declined: "secure.fraction_bits is 16; ..."                  |
| task.secure.min_survivors -> derived - 1       | declined: "secure.min_survivors is 2; ..."                   |
| task.secure.graph_seed -> another seed         | declined: "secure.graph_seed is '00..'; ..."                 |
| task.secure.site_number -> another site's      | declined: "secure.site_number is 1; ..."                     |
| phase-1 view: round_id of another round        | advertised, then declined: "... view is of round N, not M"   |
| phase-1 view: weight 1.5                       | advertised, then declined: "... weight 1.5, outside (0, 1]"  |
| phase-1 view: a peer outside the round added   | advertised, then declined: "... from non-neighbours [5]"     |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.hostile.harness import (
    SITES,
    STATISTICS,
    TRAINING,
    VICTIM,
    Federation,
    assert_declined,
    assert_not_offered_again,
    once,
    reason_of,
)

SECURE = {
    "rounds": 1,
    "min_sites": 3,
    "seed": 5,
    "training": TRAINING,
    "privacy": {"min_records": 1, "secure_aggregation": {"phase_timeout_s": 30.0}},
}
OTHERS = [site for site in SITES if site != VICTIM]


@dataclass(frozen=True)
class Scenario:
    """One alteration (of the task, or of the phase-1 round view), and what the decline's reason names."""

    id: str
    alter: Callable[[dict[str, Any]], None]
    says: str
    settle: bool = False  # a task scenario: also let the other three finish the secure round without the victim


def secure_field(name: str, value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def alter(task: dict[str, Any]) -> None:
        task["secure"][name] = value(task["secure"][name])

    return alter


def drop_secure(task: dict[str, Any]) -> None:
    task["secure"] = None


TASK_SCENARIOS = [
    Scenario(
        "secure_dropped", drop_secure, "the terms ask for secure aggregation and the task is a plain round", settle=True
    ),
    Scenario(
        "threshold_1", secure_field("threshold", lambda _: 1), "secure.threshold is 1; the terms make it 2", settle=True
    ),
    Scenario(
        "threshold_other", secure_field("threshold", lambda t: t + 1), "secure.threshold is 3; the terms make it 2"
    ),
    Scenario(
        "neighbour_count",
        secure_field("neighbour_count", lambda k: k - 1),
        "secure.neighbour_count is 2; the terms make it 3",
    ),
    Scenario(
        "fraction_bits", secure_field("fraction_bits", lambda _: 16), "secure.fraction_bits is 16; the terms make it 24"
    ),
    Scenario(
        "min_survivors",
        secure_field("min_survivors", lambda m: m - 1),
        "secure.min_survivors is 2; the terms make it 3",
    ),
    Scenario("graph_seed", secure_field("graph_seed", lambda _: "0" * 64), f"secure.graph_seed is '{'0' * 64}'"),
    Scenario("site_number", secure_field("site_number", lambda _: 1), "secure.site_number is 1; the terms make it 2"),
]


def other_round(view: dict[str, Any]) -> None:
    view["round_id"] += 1000


def impossible_weight(view: dict[str, Any]) -> None:
    view["weight"] = 1.5


def stranger(view: dict[str, Any]) -> None:
    assert view["peers"], view  # the neighbours' keys, relayed in phase 1
    view["peers"].append({**view["peers"][0], "site": len(SITES) + 1})


VIEW_SCENARIOS = [
    Scenario("view_round_id", other_round, "the secure round view is of round"),
    Scenario("view_weight", impossible_weight, "the secure round gives this site the weight 1.5, outside (0, 1]"),
    Scenario(
        "view_stranger_peer",
        stranger,
        "the secure round's view breaks its setup: advertisements from non-neighbours [5]",
    ),
]


def secure_posts(federation: Federation) -> list[str]:
    return [s.path.rsplit("/", 1)[-1] for s in federation.victim.wire.sent if s.method == "POST"]


def test_identity_proxy_the_secure_round_completes_with_the_victim(federation: Federation) -> None:
    study_id = federation.start(**SECURE)
    victim = federation.victim
    victim.wire.on_task = once(lambda task: None)
    victim.wire.on_view = lambda view: view  # every view re-encoded as it came
    federation.drive(study_id, list(federation.sites.values()), until_round=1)
    first = federation.rounds(study_id)[0]
    assert first["status"] == "completed" and sorted(u["site"] for u in first["updates"]) == sorted(SITES), first
    assert federation.has_model(study_id, 1)
    assert federation.declines(study_id) == []
    assert all(not answer.altered for answer in victim.wire.answers) and victim.wire.answers
    assert secure_posts(federation) == ["advertisement", "shares", "updates", "reveal"]
    assert [s.status for s in victim.wire.posts("/updates")] == [201]
    for sent in victim.wire.sent:  # statistics travel under the masks only
        assert not any(word in sent.body for word in STATISTICS), sent


@pytest.mark.parametrize("scenario", TASK_SCENARIOS, ids=[s.id for s in TASK_SCENARIOS])
def test_a_secure_task_altered_in_one_fact_is_declined(federation: Federation, scenario: Scenario) -> None:
    study_id = federation.start(**SECURE)
    victim = federation.victim
    victim.wire.on_task = once(scenario.alter)
    assert victim.worker.poll_once()
    (answer,) = victim.wire.tasks()
    assert answer.altered and answer.original["secure"] is not None
    round_id = answer.original["round_id"]
    assert_declined(federation, study_id, round_id, scenario.says)  # nothing in the clear: no POST but the decline
    assert victim.worker.secure is None
    assert_not_offered_again(federation, round_id)
    if not scenario.settle:
        return
    federation.drive(study_id, federation.others, until_round=1)  # the secure round goes on without the victim
    first = federation.rounds(study_id)[0]
    assert first["status"] == "completed" and sorted(u["site"] for u in first["updates"]) == OTHERS, first
    assert federation.has_model(study_id, 1)


@pytest.mark.parametrize("scenario", VIEW_SCENARIOS, ids=[s.id for s in VIEW_SCENARIOS])
def test_a_round_view_altered_mid_round_is_declined(federation: Federation, scenario: Scenario) -> None:
    study_id = federation.start(**SECURE)
    victim = federation.victim
    victim.wire.on_view = once(scenario.alter, phase=1)
    assert victim.worker.poll_once()  # an honest task: trains and advertises
    round_id = victim.wire.tasks()[0].original["round_id"]
    assert secure_posts(federation) == ["advertisement"]
    for site in federation.others:  # they advertise too: phase 0 closes
        assert site.worker.poll_once()
    assert victim.worker.poll_once()  # reads the phase-1 view, altered: declines
    assert [a.altered for a in victim.wire.answers if a.path.endswith("/secagg")] == [True]
    assert secure_posts(federation) == ["advertisement", "decline"]
    assert victim.worker.secure is None
    (decline,) = victim.wire.posts("/decline")
    assert decline.path == f"/api/v1/rounds/{round_id}/decline" and decline.status == 204
    reason = reason_of(decline.body)
    assert scenario.says in reason, reason
    if scenario.alter is other_round:
        assert f"of round {round_id + 1000}, not {round_id}" in reason, reason
    events = federation.declines(study_id)
    assert [(e["round_id"], e["detail"]["reason"]) for e in events] == [(round_id, reason)]
    assert_not_offered_again(federation, round_id)

    federation.drive(study_id, federation.others, until_round=1)  # the others unmask the victim's pairwise masks
    assert secure_posts(federation) == ["advertisement", "decline"]  # no shares, masked update or reveal, ever
    first = federation.rounds(study_id)[0]
    assert first["status"] == "completed" and sorted(u["site"] for u in first["updates"]) == OTHERS, first
    assert federation.has_model(study_id, 1)
    for sent in victim.wire.sent:
        assert not any(word in sent.body for word in STATISTICS), sent
