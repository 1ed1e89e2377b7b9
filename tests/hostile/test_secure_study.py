"""A hostile coordinator against real site agents, secure study: each secure-setup fact altered alone is declined.

The same four real agents and real coordinator as tests/hostile/test_plain_study.py (SQLite and
PostgreSQL), on a study under secure aggregation (SecAgg+ against a server colluding with c = 0
sites, so a round can lose one: 4 sites, min_sites 3, min_records 1 so the sites' counts and
histograms exist and must travel under the masks only; every site's Ed25519 key in the terms). The
victim, oslo, reaches the coordinator through a HostileTransport that rewrites one thing in the
first task it receives, or in the secure round's phase-1 view it reads after it advertised honestly
(in the relay row every site is a victim, of one alteration each). The hub cannot sign for a site:
an advertisement it alters no longer bears its site's signature.

A declined task: the victim POSTs the decline (reason naming the field), sends nothing else (no
advertisement, shares, update or reveal: nothing in the clear), downloads nothing, the audit holds
`task.declined`, its next poll gets nothing, and in the `settle` rows the other three finish the
secure round without it (theta^g_1 is released). A round view altered mid-round: the victim had
advertised, then declines and sends no later-phase message (no shares, so no secret of it is held by
anyone); in the `settle` rows the other three finish the round without it. Phases: 0 advertise,
1 share, 2 mask (the masked update), 3 consistency (sign the survivor set), 4 reveal.

Derived setup of round 1 for 4 participants: site numbers 1..4 (lyon 1, oslo 2), neighbour_count 3
(complete graph), threshold 2 (2t > k + c), signature_quorum 3 (floor((K + c) / 2) + 1), min_survivors 3,
fraction_bits 24, ring_bits 32, graph seed from (study uid, round, attempt).

| alteration                                              | outcome                                                    |
| ------------------------------------------------------- | ---------------------------------------------------------- |
| none (identity on the victim's tasks and views)         | advertisement, shares, update, consistency, reveal; done   |
| chosen weights: every view of a second study names a   | no effect: theta^g_1 is the in-process runner's (cardiofl  |
| weight (oslo 1.0, the others 0.0)                       | simulate_study) within 1e-6, with its weights              |
| a second study of the same seed: theta^g_0's tensors    | every site declines its round 1 before training: "took     |
| the same, in other bytes (metadata)                     | part in a secure round from theta^g's tensors ... before"  |
| task.secure -> null                                     | declined: "the terms ask for secure aggregation and ..."   |
| task.secure.threshold -> 1                              | declined: "secure.threshold is 1; the terms make it 2"     |
| task.secure.threshold -> derived + 1                    | declined: "secure.threshold is 3; ..."                     |
| task.secure.neighbour_count -> derived - 1              | declined: "secure.neighbour_count is 2; ..."               |
| task.secure.fraction_bits -> 16                         | declined: "secure.fraction_bits is 16; ..."                |
| task.secure.ring_bits -> 64 (the values, not changes)   | declined: "secure.ring_bits is 64; the terms make it 32"   |
| terms...ring_bits -> 64 (allowed, not approved)         | declined: "... approved at ...ring_bits"                   |
| task.secure.min_survivors -> derived - 1                | declined: "secure.min_survivors is 2; ..."                 |
| task.secure.signature_quorum -> derived - 1             | declined: "secure.signature_quorum is 2; ..."              |
| task.secure.graph_seed -> another seed                  | declined: "secure.graph_seed is '00..'; ..."               |
| task.secure.site_number -> another site's               | declined: "secure.site_number is 1; ..."                   |
| terms...site_keys.lyon -> the hub's key (substituted)   | declined: "... approved at ...site_keys.lyon"              |
| terms...site_keys.oslo -> the hub's key                 | declined: "... approved at ...site_keys.oslo"              |
| terms...colluding -> 1 (allowed, not approved)          | declined: "... approved at ...colluding"                   |
| terms...threshold -> 3 (allowed, not approved)          | declined: "... approved at ...threshold"                   |
| terms...threshold -> 1 (2t <= k + c: splittable)        | unreadable, declined: "...threshold: ... at least ... 2"   |
| terms...colluding -> 3 (of 4 sites)                     | unreadable, declined: "...colluding: 3 colluding ..."      |
| phase-1 view: round_id of another round                 | advertised, then declined: "... view is of round N, not M" |
| phase-1 view: a stranger (site 5) among the peers       | declined: "...of site 5 is not in round 1, attempt 1"      |
| phase-1 views, one fact each, every site a victim:      | each reader shares nothing, declines: "site N's            |
|   oslo reads lyon's cipher_public -> the hub's key      | advertisement is not signed by its signing key" (N: the    |
|   lyon reads rome's mask_public -> the hub's key        | owner); no shares at all: the round fails in phase 1       |
|   rome reads turin's global_sha256 -> another theta^g   | ("phase share: 0 of 0 sites"), the retry opens attempt 2   |
|   turin reads oslo's num_examples doubled (a weight)    |                                                            |
| study created with threshold 1 or 2 (c = 1: 2t > k + c  | 422 naming privacy.secure_aggregation.threshold (or        |
| needs 3), colluding 3, threshold 4 (above k = 3), or    | .colluding); nothing created                               |
| colluding 2 with rounds of 3 sites (random dropout)     |                                                            |

Strategies over several phases or attempts (equivocation, theta^g per site, retries, replays) are
in tests/hostile/test_secure_hub.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cardiofl.experiment.runner import simulate_study
from shared.privacy.keys import RoundKeys
from shared.privacy.signing import SiteIdentity
from shared.tensors.codec import load
from shared.terms import StudyTerms
from shared.wire.protocol import PROTOCOL_VERSION
from shared.wire.secure import b64
from site_agent.data import SiteData
from tests.coordinator.factories import ADMIN, study_config
from tests.hostile.harness import (
    CPU,
    NUMBER,
    OTHERS,
    SECURE,
    SITES,
    STATISTICS,
    VICTIM,
    Federation,
    assert_declined,
    assert_not_offered_again,
    once,
    posted,
    reason_of,
    relayed,
    set_path,
    the_decline,
)
from tests.hostile.proxy import Alteration

AGGREGATION = "terms.privacy.secure_aggregation"
HUB_KEY = SiteIdentity.generate().public_hex()  # a signing key whose private half the hub holds
UNREADABLE = f"the task is not a valid protocol {PROTOCOL_VERSION} task: "


@dataclass(frozen=True)
class Scenario:
    """One alteration (of the task, or of the phase-1 round view), and what the decline's reason names."""

    id: str
    alter: Callable[[dict[str, Any]], None]
    says: str
    settle: bool = False  # also let the other three finish the secure round without the victim
    unreadable: bool = False  # the task's terms fail validation: declined by its round_id, no task taken


def secure_field(name: str, value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def alter(task: dict[str, Any]) -> None:
        task["secure"][name] = value(task["secure"][name])

    return alter


def setting(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda task: set_path(task, path, value)


def drop_secure(task: dict[str, Any]) -> None:
    task["secure"] = None


def approved_at(path: str) -> str:
    return f"its terms differ from those this site's operator approved at {path.removeprefix('terms.')}"


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
    Scenario("ring_bits", secure_field("ring_bits", lambda _: 64), "secure.ring_bits is 64; the terms make it 32"),
    Scenario("ring_bits_terms", setting(f"{AGGREGATION}.ring_bits", 64), approved_at(f"{AGGREGATION}.ring_bits")),
    Scenario(
        "min_survivors",
        secure_field("min_survivors", lambda m: m - 1),
        "secure.min_survivors is 2; the terms make it 3",
    ),
    Scenario(
        "signature_quorum",
        secure_field("signature_quorum", lambda q: q - 1),
        "secure.signature_quorum is 2; the terms make it 3",
    ),
    Scenario("graph_seed", secure_field("graph_seed", lambda _: "0" * 64), f"secure.graph_seed is '{'0' * 64}'"),
    Scenario("site_number", secure_field("site_number", lambda _: 1), "secure.site_number is 1; the terms make it 2"),
    Scenario(
        "site_key_of_a_peer",
        setting(f"{AGGREGATION}.site_keys.lyon", HUB_KEY),
        approved_at(f"{AGGREGATION}.site_keys.lyon"),
    ),
    Scenario(
        "site_key_of_its_own",
        setting(f"{AGGREGATION}.site_keys.oslo", HUB_KEY),
        approved_at(f"{AGGREGATION}.site_keys.oslo"),
    ),
    Scenario("colluding_allowed", setting(f"{AGGREGATION}.colluding", 1), approved_at(f"{AGGREGATION}.colluding")),
    Scenario("threshold_allowed", setting(f"{AGGREGATION}.threshold", 3), approved_at(f"{AGGREGATION}.threshold")),
    Scenario(
        "threshold_splittable",
        setting(f"{AGGREGATION}.threshold", 1),
        f"{UNREADABLE}{AGGREGATION}.threshold: threshold 1 with the complete graph in a round of 4 sites lets a "
        "coordinator colluding with 0 sites (0 of them a site's neighbours) split the honest neighbours",
        unreadable=True,
    ),
    Scenario(
        "colluding_too_many",
        setting(f"{AGGREGATION}.colluding", 3),
        f"{UNREADABLE}{AGGREGATION}.colluding: 3 colluding sites of 4 leave fewer than two honest ones",
        unreadable=True,
    ),
]


def other_round(view: dict[str, Any]) -> None:
    view["round_id"] += 1000


def stranger(view: dict[str, Any]) -> None:
    assert len(view["peers"]) == len(SITES), view  # every advertisement, relayed in phase 1
    view["peers"].append({**view["peers"][0], "site": len(SITES) + 1})


VIEW_SCENARIOS = [
    Scenario("view_round_id", other_round, "the secure round view is of round", settle=True),
    Scenario(
        "view_stranger_peer",
        stranger,
        "the secure round's view breaks its setup: an advertisement of site 5 is not in round 1, attempt 1",
    ),
]


def advertisement_of(site: str, field: str, value: Callable[[Any], Any]) -> Alteration:
    """In the phase-1 view: one field of `site`'s relayed advertisement changed by the hub, which cannot re-sign it."""

    def alter(view: dict[str, Any]) -> None:
        peer = relayed(view, site)
        peer[field] = value(peer[field])

    return once(alter, phase=1)


RELAYED = {  # reader: (whose advertisement, which field, the hub's value)
    "oslo": ("lyon", "cipher_public", lambda _: b64(RoundKeys.generate().cipher_public())),  # a man in the middle
    "lyon": ("rome", "mask_public", lambda _: b64(RoundKeys.generate().mask_public())),
    "rome": ("turin", "global_sha256", lambda _: "e" * 64),  # another theta^g than turin trained from
    "turin": ("oslo", "num_examples", lambda n: 2 * n),  # a weight the hub chose for oslo
}


def naming_weight(round_id: int, weight: float) -> Alteration:
    def alter(view: dict[str, Any]) -> dict[str, Any] | None:
        if view["round_id"] != round_id:
            return None
        view["weight"] = weight  # what the hub would have the site weigh its update with
        return view

    return alter


def test_identity_proxy_completes_and_weights_the_hub_names_change_nothing(
    federation: Federation, site_data: dict[str, SiteData]
) -> None:
    """The control (nothing altered), then a study with every view naming a weight: each the runner's theta^g_1.

    The second study has another seed (the same seed would serve the same theta^g_0, which every site
    declines: test_a_second_study_serving_the_same_theta_g_is_declined_by_every_site); each released
    theta^g_1 is the in-process runner's on the same data and terms (the study's own weights), within
    the fixed-point encoding's error.
    """
    control, chosen = federation.start(**SECURE), federation.start(**{**SECURE, "seed": 6})
    victim = federation.victim
    victim.wire.on_task = once(lambda task: None)
    victim.wire.on_view = lambda view: view  # every view re-encoded as it came
    federation.drive(control, federation.everyone, until_round=1)
    first = federation.rounds(control)[0]
    assert first["status"] == "completed" and sorted(u["site"] for u in first["updates"]) == sorted(SITES), first
    assert federation.declines(control) == []
    assert all(not answer.altered for answer in victim.wire.answers) and victim.wire.answers
    for site in federation.everyone:  # the five phases, one message each, all taken
        assert posted(site) == ["advertisement", "shares", "updates", "consistency", "reveal"], site.name
        assert all(s.status == 201 for s in site.wire.sent if s.method == "POST"), site.name
    for sent in victim.wire.sent:  # statistics travel under the masks only
        assert not any(word in sent.body for word in STATISTICS), sent

    round_id = federation.rounds(chosen)[0]["id"]
    for site in federation.everyone:  # oslo is told its weight is 1, the others 0
        site.wire.on_view = naming_weight(round_id, 1.0 if site is victim else 0.0)
    federation.drive(chosen, federation.everyone, until_round=1)
    for site in federation.everyone:  # every view of the round named the hub's weight; the site took part
        views = [a for a in site.wire.answers if a.path == f"/api/v1/rounds/{round_id}/secagg"]
        assert views and all(a.altered and "weight" in a.received for a in views), site.name
        assert posted(site, round_id) == ["advertisement", "shares", "updates", "consistency", "reveal"]
    second = federation.rounds(chosen)[0]
    assert second["status"] == "completed"
    for study, shown in ((control, first), (chosen, second)):
        weights = {u["site"]: u["weight"] for u in shown["updates"]}
        assert 0 < weights[VICTIM] < 0.5
        released, _ = load(federation.model(study, 1))
        terms = StudyTerms.model_validate(federation.get(f"/api/v1/studies/{study}")["config"])
        simulated = next(simulate_study(terms, site_data, CPU, evaluate_final=False))
        assert simulated.weights == weights
        assert sorted(released) == sorted(simulated.global_model)
        for name, tensor in simulated.global_model.items():
            assert torch.allclose(released[name].double(), tensor.double(), rtol=0, atol=1e-6), name


def test_a_second_study_serving_the_same_theta_g_is_declined_by_every_site(federation: Federation) -> None:
    """Two secure studies of one seed, model and data: theta^g_0's tensors, and so every honest update, alike.

    The hub could difference the two rounds' sums over different sites; every site declines the second
    study's round (its ledger holds theta^g_0's tensors, under the first study's round 1) before training.
    """
    first, second = federation.start(**SECURE), federation.start(**SECURE)
    federation.drive(first, federation.everyone, until_round=1)
    assert federation.rounds(first)[0]["status"] == "completed"
    digests = [federation.rounds(study)[0]["base_sha256"] for study in (first, second)]
    assert digests[0] != digests[1]  # the bytes differ (their metadata names the study); the tensors do not
    released = [load(federation.model(study, 0))[0] for study in (first, second)]
    assert all(torch.equal(released[0][name], released[1][name]) for name in released[0])
    round_id = federation.rounds(second)[0]["id"]
    federation.poll(federation.everyone)  # each reads the first study's round 1 end
    federation.poll(federation.everyone)  # each downloads theta^g_0 of the second study, and declines
    declines = federation.declines(second)
    assert len(declines) == len(SITES) and {e["round_id"] for e in declines} == {round_id}
    retry = federation.rounds(second)[1]  # the round failed with no advertisement; the retry policy opens another
    assert (retry["attempt"], retry["status"]) == (2, "open") and "advertise: 0 of 0" in federation.rounds(second)[0][
        "note"
    ]
    for event in declines:
        assert "this site took part in a secure round from theta^g's tensors" in event["detail"]["reason"]
        assert f"before (round 1 of study {first}-" in event["detail"]["reason"]
    for site in federation.everyone:
        assert posted(site, round_id) == ["decline"], site.name  # no advertisement: nothing trained or sent


@pytest.mark.parametrize("scenario", TASK_SCENARIOS, ids=[s.id for s in TASK_SCENARIOS])
def test_a_secure_task_altered_in_one_fact_is_declined(federation: Federation, scenario: Scenario) -> None:
    study_id = federation.start(**SECURE)
    victim = federation.victim
    victim.wire.on_task = once(scenario.alter)
    assert victim.worker.poll_once() is not scenario.unreadable  # an unreadable task: no task taken
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
    assert posted(victim) == ["advertisement"]
    federation.poll(federation.others)  # they advertise too: phase 0 closes
    assert victim.worker.poll_once()  # reads the phase-1 view, altered: declines
    assert [a.altered for a in victim.wire.answers if a.path.endswith("/secagg")] == [True]
    assert posted(victim) == ["advertisement", "decline"]
    assert victim.worker.secure is None
    reason = the_decline(federation, study_id, round_id)  # at the round attempt's own URL
    assert scenario.says in reason, reason
    if scenario.alter is other_round:
        assert f"of round {round_id + 1000}, not {round_id}" in reason, reason
    assert_not_offered_again(federation, round_id)
    for sent in victim.wire.sent:
        assert not any(word in sent.body for word in STATISTICS), sent
    if not scenario.settle:
        return
    federation.drive(study_id, federation.others, until_round=1)  # the others unmask the victim's pairwise masks
    assert posted(victim) == ["advertisement", "decline"]  # no shares, masked update or reveal, ever
    first = federation.rounds(study_id)[0]
    assert first["status"] == "completed" and sorted(u["site"] for u in first["updates"]) == OTHERS, first
    assert federation.has_model(study_id, 1)


def test_advertisements_the_hub_altered_are_refused_by_every_site(federation: Federation) -> None:
    """Each site reads one other site's advertisement altered (RELAYED): each shares nothing and declines."""
    study_id = federation.start(**SECURE)
    for reader, (owner, field, value) in RELAYED.items():
        federation.sites[reader].wire.on_view = advertisement_of(owner, field, value)
    federation.poll(federation.everyone)  # each trains and advertises: phase 0 closes
    federation.poll(federation.everyone)  # each reads the phase-1 view, altered: declines
    round_id = federation.rounds(study_id)[0]["id"]
    declines = {e["actor"]: e["detail"]["reason"] for e in federation.declines(study_id)}
    assert len(declines) == len(SITES)
    for reader, (owner, field, _) in RELAYED.items():
        site, number = federation.sites[reader], NUMBER[owner]
        (answer,) = [a for a in site.wire.answers if a.altered]
        pairs = zip(answer.original["peers"], answer.received["peers"], strict=True)
        assert [(o["site"], [k for k in o if o[k] != r[k]]) for o, r in pairs if o != r] == [(number, [field])]
        assert posted(site) == ["advertisement", "decline"], reader  # no shares: nobody holds a secret of it
        (reason,) = [reason for actor, reason in declines.items() if reader in actor]
        says = f"the secure round's view breaks its setup: site {number}'s advertisement is not signed by its signing"
        assert says in reason, (reader, reason)
        assert reason_of(site.wire.posts(f"/api/v1/rounds/{round_id}/decline")[0].body) == reason
    assert all("shares" not in posted(site) for site in federation.everyone)
    first, retry = federation.rounds(study_id)  # no shares at all: phase 1 fails, the retry opens attempt 2
    assert first["status"] == "failed" and "phase share: 0 of 0 sites, 3 needed" in first["note"], first
    assert (retry["attempt"], retry["status"]) == (2, "open")


REFUSED_AT_CREATION = [  # (secure aggregation's settings, other terms, the setting named, what it says)
    ({"threshold": 1}, {}, "threshold", "t must be at least floor((k + m) / 2) + 1 = 3"),  # c = 1 by default
    ({"threshold": 2}, {}, "threshold", "split the honest neighbours"),  # protocol 5's default at K = 4, c = 1
    ({"colluding": 3}, {}, "colluding", "3 colluding sites of 4 leave fewer than two honest ones"),
    ({"threshold": 4}, {}, "threshold", "a threshold of 4 cannot exceed it"),  # a 4-site round has 3 neighbours
    (  # a policy that may pick 3 sites: t > k = 2 there
        {"colluding": 2},
        {"participation": {"name": "random"}},
        "colluding",
        "2 colluding sites need a threshold of at least 3",
    ),
]


def test_a_secure_study_the_rules_do_not_allow_is_refused_at_creation(federation: Federation) -> None:
    for site in federation.everyone:
        site.worker.register_identity()
    for secure, other, field, says in REFUSED_AT_CREATION:
        privacy = {"min_records": 1, "secure_aggregation": secure}
        config = study_config(list(SITES), **{**SECURE, **other, "privacy": privacy})
        response = federation.coordinator.post("/api/v1/studies", json={"name": "x", "config": config}, headers=ADMIN)
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        assert message.startswith(f"body.config.privacy.secure_aggregation.{field}: "), message
        assert says in message, message
    assert federation.get("/api/v1/studies")["data"] == []  # nothing was created
