"""A hostile coordinator against real site agents, plain study: every fact of a task altered alone is declined.

Four real agents (lyon, oslo, rome, turin: SiteWorker, real local training of the tiny model on
synthetic records) talk to the real coordinator app, on SQLite and on PostgreSQL. The victim, oslo,
reaches it through a HostileTransport (tests/hostile/proxy.py) that rewrites one thing in the first
task it receives; the other sites' answers are never altered. The victim's operator approved the
study as offered (offers are never altered); the other agents run with auto_approve. The study is
FedProx (mu 0.01, so the terms have algorithm parameters), 2 rounds, min_sites 3: round 1 can close
without the victim.

For each alteration the victim (1) POSTs a decline to the round attempt's own decline URL, whose
reason names what differs; (2) sends no update and no other POST; (3) downloads nothing, not even
theta^g_0 (the check comes first); (4) the coordinator's audit holds `task.declined` with that reason;
(5) its next poll gets no task while the round is still open. In the scenarios marked `settle` the
other three sites then close the round without it (3 trainings each: only a few, to keep the suite
quick). The control (the proxy on, nothing altered) trains and uploads.

The terms scenarios use an operator-approved victim; the last row shows that an agent with
auto_approve, which approves every offer, still declines a task whose terms no offer brought.

| alteration of the victim's task                        | outcome                                                  |
| ------------------------------------------------------- | -------------------------------------------------------- |
| none (identity: proxy on, JSON re-encoded as is)        | trains, downloads theta^g_0, POST /updates -> 201        |
| terms.model.heads 6:2 -> 4:4                            | declined: "... approved at model.heads"                  |
| terms.model.preset tiny -> small                        | declined: "... approved at model.preset"                 |
| terms.algorithm.params.mu 0.01 -> 1.0                   | declined: "... approved at algorithm.params.mu"          |
| terms.rounds 2 -> 3                                     | declined: "... approved at rounds"                       |
| terms.privacy.min_records 20 -> 1                       | declined: "... approved at privacy.min_records"          |
| terms.training.lr 0.05 -> 0.5                           | declined: "... approved at training.lr"                  |
| terms.seed 11 -> 12                                     | declined: "... approved at seed"                         |
| load_factor 1.0 -> 2.0                                  | declined: "load factor 2.0; 4 sites over 4 is 1.0"       |
| participants without rome                               | declined: "participants: names [...]; 'all' picks [...]" |
| kind train -> evaluate                                  | declined: "round 1 is a train round, the task says ..."  |
| attempt 1 -> 4 (round_retries 2)                        | declined: "attempt 4 is beyond the 2 retries ..."        |
| global_model_url -> another study's theta^g_0           | declined: "global_model_url is '.../studies/<other>/...'" |
| update_url -> another round's                           | declined: "update_url is ..."                            |
| decline_url -> another round's                          | declined: "decline_url is ...", at the round's own URL   |
| secure block added (plausible SecureRoundInfo)          | declined: "the task is a secure round and the terms ..." |
| unknown key inside terms                                | unreadable, declined by round_id: "terms.backdoor: ..."  |
| terms.training.lr, victim with auto_approve             | declined: auto_approve approves offers, never a task     |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from shared.wire.protocol import PROTOCOL_VERSION
from tests.hostile.harness import (
    SITES,
    TRAINING,
    VICTIM,
    Federation,
    assert_declined,
    assert_not_offered_again,
    once,
    set_path,
)

PLAIN = {
    "rounds": 2,
    "min_sites": 3,
    "seed": 11,
    "training": TRAINING,
    "algorithm": {"name": "fedprox", "params": {"mu": 0.01}},
}
OTHERS = [site for site in SITES if site != VICTIM]


@dataclass(frozen=True)
class Scenario:
    """One alteration of the victim's task (`alter(task, other_study_id)`), and what the decline's reason names."""

    id: str
    alter: Callable[[dict[str, Any], int], None]
    says: str
    other_study: bool = False  # the alteration points at a second, started study
    settle: bool = False  # also let the other three sites close the round without the victim (3 trainings)


def setting(path: str, value: Any) -> Callable[[dict[str, Any], int], None]:
    return lambda task, _: set_path(task, path, value)


def plausible_secure(task: dict[str, Any], _: int) -> None:
    task["secure"] = {
        "site_number": SITES.index(VICTIM) + 1,
        "sites": {site: number for number, site in enumerate(SITES, start=1)},
        "graph_seed": "ab" * 32,
        "neighbour_count": 3,
        "threshold": 2,
        "signature_quorum": 3,
        "min_survivors": 3,
        "fraction_bits": 24,
        "ring_bits": 32,
        "url": f"/api/v1/rounds/{task['round_id']}/secagg",
    }


def other_round(name: str, suffix: str) -> Callable[[dict[str, Any], int], None]:
    return lambda task, _: set_path(task, name, f"/api/v1/rounds/{task['round_id'] + 1000}/{suffix}")


def other_study_model(task: dict[str, Any], other: int) -> None:
    task["global_model_url"] = f"/api/v1/studies/{other}/models/0"


SCENARIOS = [
    Scenario("model.heads", setting("terms.model.heads", "4:4"), "approved at model.heads"),
    Scenario("model.preset", setting("terms.model.preset", "small"), "approved at model.preset"),
    Scenario("algorithm.params", setting("terms.algorithm.params.mu", 1.0), "approved at algorithm.params.mu"),
    Scenario("rounds", setting("terms.rounds", 3), "approved at rounds"),
    Scenario("privacy.min_records", setting("terms.privacy.min_records", 1), "approved at privacy.min_records"),
    Scenario("training.lr", setting("terms.training.lr", 0.5), "approved at training.lr", settle=True),
    Scenario("seed", setting("terms.seed", 12), "approved at seed"),
    Scenario("load_factor", setting("load_factor", 2.0), "load factor 2.0; 4 sites over 4 is 1.0"),
    Scenario(
        "participants",
        setting("participants", sorted(set(SITES) - {"rome"})),
        "participants: names ['lyon', 'oslo', 'turin']; 'all' picks ['lyon', 'oslo', 'rome', 'turin']",
        settle=True,
    ),
    Scenario("kind", setting("kind", "evaluate"), "round 1 is a train round, the task says evaluate"),
    Scenario("attempt", setting("attempt", 4), "attempt 4 is beyond the 2 retries"),
    Scenario(
        "global_model_url", other_study_model, "global_model_url is '/api/v1/studies/", other_study=True, settle=True
    ),
    Scenario("update_url", other_round("update_url", "updates"), "update_url is '/api/v1/rounds/"),
    Scenario("decline_url", other_round("decline_url", "decline"), "decline_url is '/api/v1/rounds/"),
    Scenario(
        "secure_added", plausible_secure, "the task is a secure round and the terms ask for no secure aggregation"
    ),
    Scenario(
        "unknown_terms_key",
        setting("terms.backdoor", True),
        f"is not a valid protocol {PROTOCOL_VERSION} task: terms.backdoor: Extra inputs are not permitted",
        settle=True,
    ),
]


def test_identity_proxy_the_victim_trains_and_uploads(federation: Federation) -> None:
    study_id = federation.start(**PLAIN)
    victim = federation.victim
    victim.wire.on_task = once(lambda task: None)  # the task re-encoded as it came
    assert victim.worker.poll_once()
    (answer,) = victim.wire.tasks()
    assert answer.status == 200 and answer.received == answer.original
    round_id = answer.original["round_id"]
    assert [s.path for s in victim.wire.gets(f"/api/v1/studies/{study_id}/models/0")]  # the proxy sees downloads
    (upload,) = victim.wire.posts("/updates")
    assert (upload.path, upload.status) == (f"/api/v1/rounds/{round_id}/updates", 201)
    assert victim.wire.posts("/decline") == []
    assert federation.declines(study_id) == []
    federation.drive(study_id, federation.others, until_round=1)
    first = federation.rounds(study_id)[0]
    assert first["status"] == "completed" and sorted(u["site"] for u in first["updates"]) == sorted(SITES)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
def test_a_task_altered_in_one_fact_is_declined(federation: Federation, scenario: Scenario) -> None:
    study_id = federation.start(**PLAIN)
    other = federation.start(OTHERS, **PLAIN) if scenario.other_study else 0
    victim = federation.victim
    victim.wire.on_task = once(lambda task: scenario.alter(task, other))
    assert victim.worker.poll_once() == (scenario.id != "unknown_terms_key")  # an unreadable task: no task taken
    (answer,) = victim.wire.tasks()
    assert answer.altered
    round_id = answer.original["round_id"]
    reason = assert_declined(federation, study_id, round_id, scenario.says)
    if scenario.other_study:
        assert f"'/api/v1/studies/{other}/models/0', not '/api/v1/studies/{study_id}/models/0'" in reason
    assert victim.worker.declined == {round_id: victim.worker.declined[round_id]}
    assert_not_offered_again(federation, round_id)
    if not scenario.settle:
        return
    federation.drive(study_id, federation.others, until_round=1)  # the round settles without the victim
    first = federation.rounds(study_id)[0]
    assert first["id"] == round_id and first["status"] == "completed", first
    assert sorted(u["site"] for u in first["updates"]) == OTHERS


def test_an_auto_approving_agent_declines_terms_it_was_never_offered(federation: Federation) -> None:
    study_id = federation.start(**PLAIN)
    victim = federation.victim
    victim.worker.approvals.auto_approve = True  # approved as offered (start), and auto_approve on as in a demo
    victim.wire.on_task = once(lambda task: set_path(task, "terms.training.lr", 0.5))
    victim.worker.poll_once()
    round_id = victim.wire.tasks()[0].original["round_id"]
    assert victim.wire.posts("/updates") == [], "the agent trained with lr 0.5, which no offer said, and uploaded"
    assert_declined(federation, study_id, round_id, "approved at training.lr")
