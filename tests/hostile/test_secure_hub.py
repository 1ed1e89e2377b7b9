"""A hostile hub against real site agents, secure study: strategies over several phases and attempts (issue #28).

The four real agents and the real coordinator of tests/hostile/test_secure_study.py (SQLite and
PostgreSQL; 4 sites, min_sites 3, c = 0: t = 2, 3 consistency signatures, min_survivors 3; lyon is
site 1, oslo site 2; the hub with colluding sites is tests/hostile/test_split_view.py's). Here
the hub plays a whole strategy: it rewrites what one or every site reads over several phases (the
proxy), signs with a site's key the test holds where a site would itself have signed honestly (the
hub gave it another model), fails a round where the coordinator's own failure path would (an
aggregation that raises, a phase deadline run out: `Federation.tick`), and replays what it saw in
another attempt. Each row asserts values and the bytes on the wire: who POSTed what, the reveals'
shares, the released theta^g, the audit, the sites' encrypted stores.

| hub's alteration                                           | outcome                                                |
| ---------------------------------------------------------- | ------------------------------------------------------ |
| phase 4: lyon dropped, for oslo only (it signed lyon alive | oslo reveals nothing, declines: "signed another        |
| in phase 3)                                                | survivor set"; no owner's self-mask and mask-key       |
|                                                            | shares both revealed; the round sums the 4 inputs      |
| phases 3 and 4: lyon dropped, for oslo only; its signature | the coordinator refuses that signature (422); the hub  |
| of that set relayed as taken, lyon's withheld              | relays it anyway: oslo sees the others' signatures of  |
|                                                            | another set, declines: "the server told sites          |
|                                                            | different stories"; reveals nothing                    |
| task: theta^g_0 of another study (URL and digest)          | declined before any download: "global_model_url is .." |
| task: only the digest of another theta^g (the URL is the   | the download's digest check fails (IntegrityError): no |
| one the site derives)                                      | training, no advertisement, no decline                 |
| phase 1: lyon's advertisement of another theta^g, signed   | oslo shares nothing, declines: "site 1 trained from    |
| by lyon (the hub gave lyon another model)                  | theta^g ..., this site from ...: different models"     |
| the round fails after every site revealed (the aggregation | every site declines attempt 2: "revealed its shares in |
| raises); the retry policy opens attempt 2                  | attempt 1"; none advertises; the record is encrypted   |
|                                                            | in each store; the study fails, retries spent          |
| the same, and oslo's attempt-2 task relabelled attempt 1   | declined, nothing trained or sent: "this site revealed |
| (secure block recomputed: public), its round_id unchanged  | its shares in attempt 1 of round 1"                    |
| attempt 1 fails in phase 1 (its deadline); attempt 2's     | oslo shares nothing in attempt 2, declines: "site N's  |
| phase-1 view relays oslo the others' attempt-1 ads         | advertisement is not signed by its signing key"; the   |
|                                                            | other three complete attempt 2 without it              |
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest

from coordinator.rounds import secure as secure_workflow
from shared.privacy.messages import KeyAdvertisement
from shared.privacy.signing import RoundContext, verify
from shared.study.round_terms import secure_round_info
from shared.terms import StudyTerms
from shared.wire.secure import from_b64
from site_agent.approvals import study_key
from site_agent.errors import IntegrityError, TaskRejected
from site_agent.ledger import LEDGER, revealed_attempt
from tests.hostile.harness import (
    NUMBER,
    OTHERS,
    SECURE,
    SITES,
    VICTIM,
    Federation,
    Site,
    assert_declined,
    once,
    posted,
    relayed,
    the_decline,
)
from tests.hostile.proxy import Alteration

LYON, OSLO = NUMBER["lyon"], NUMBER[VICTIM]
SECURE_URL = "/api/v1/rounds/{}/secagg"


def store_key(federation: Federation, study_id: int) -> str:
    """Where the sites' stores keep the study's records."""
    return study_key(study_id, federation.get(f"/api/v1/studies/{study_id}")["uid"])


def reveals(federation: Federation, round_id: int) -> dict[str, dict[str, Any]]:
    """The reveal each site POSTed to the round (and the coordinator took), as sent."""
    found = {}
    for site in federation.everyone:
        for sent in site.wire.posts(f"{SECURE_URL.format(round_id)}/reveal"):
            assert sent.status == 201, sent
            found[site.name] = json.loads(sent.body)
    return found


def assert_no_owner_unmasked(federation: Federation, round_id: int) -> None:
    """No site's self-mask seed and mask key were both revealed: each owner's shares are of one kind only."""
    sent = reveals(federation, round_id).values()
    self_masks = {int(owner) for reveal in sent for owner in reveal["self_mask_shares"]}
    mask_keys = {int(owner) for reveal in sent for owner in reveal["mask_key_shares"]}
    assert self_masks and not self_masks & mask_keys, (self_masks, mask_keys)


def advertisement(peer: dict[str, Any], global_digest: str | None = None) -> KeyAdvertisement:
    """A relayed advertisement as a site checks it (naming `global_digest` instead of its own, if given)."""
    keys = from_b64(peer["cipher_public"]), from_b64(peer["mask_public"])
    digest = peer["global_sha256"] if global_digest is None else global_digest
    return KeyAdvertisement(peer["site"], *keys, peer["num_examples"], peer["report"], digest)


def context_of(task: dict[str, Any], attempt: int | None = None) -> RoundContext:
    """What every signature of the task's round attempt (or of another `attempt` of the round) names."""
    attempt = task["attempt"] if attempt is None else attempt
    return RoundContext(task["study_uid"], task["round"], attempt, task["global_model_sha256"])


def lyon_dropped(view: dict[str, Any]) -> None:
    view["survivors"] = [site for site in view["survivors"] if site != LYON]
    view["dropped"] = sorted([*view["dropped"], LYON])


def equivocate_to(victim: Site) -> Alteration:
    """Phases 3 and 4: lyon dropped; phase 4 also relays the victim's own signature of that set as taken."""

    def alter(view: dict[str, Any]) -> dict[str, Any] | None:
        if view["phase"] not in (3, 4):
            return None
        lyon_dropped(view)
        if view["phase"] == 4:  # a story that holds together: lyon, dropped, signed nothing
            view["signatures"].pop(str(LYON))
            (signed,) = victim.wire.posts("/consistency")
            view["signatures"][str(OSLO)] = json.loads(signed.body)["signature"]
            view["sent"] = sorted({*view["sent"], 3})
        return view

    return alter


def only_in_phase_4(federation: Federation, study_id: int) -> None:
    federation.victim.wire.on_view = once(lyon_dropped, phase=4)
    federation.drive(study_id, federation.everyone, until_round=1)


def in_phases_3_and_4(federation: Federation, study_id: int) -> None:
    victim = federation.victim
    victim.wire.on_view = equivocate_to(victim)
    for _ in range(3):  # advertise, share, mask: phase 3 opens
        federation.poll(federation.everyone)
    federation.poll(federation.others)  # they sign the survivor set they were told: all four
    with pytest.raises(TaskRejected, match="consistency signature is not of this round's survivor set"):
        victim.worker.poll_once()  # signs the set it was told; the coordinator, checking as the sites do, refuses
    assert [s.status for s in victim.wire.posts("/consistency")] == [422]
    federation.tick(after_s=60)  # phase 3's deadline: three signatures, the quorum of 3: the reveal phase
    federation.drive(study_id, federation.everyone, until_round=1)


@pytest.mark.parametrize(
    ("equivocate", "says"),
    [
        (only_in_phase_4, "site 2 signed another survivor set than the one it is asked to reveal"),
        (in_phases_3_and_4, "site 3's consistency signature is not of the survivor set this site signed: the server"),
    ],
    ids=["phase_4", "phases_3_and_4"],
)
def test_survivor_sets_the_hub_equivocates_are_refused(
    federation: Federation, equivocate: Callable[[Federation, int], None], says: str
) -> None:
    study_id = federation.start(**SECURE)
    round_id = federation.rounds(study_id)[0]["id"]
    equivocate(federation, study_id)
    victim = federation.victim
    assert posted(victim, round_id)[-1] == "decline" and "reveal" not in posted(victim, round_id)
    reason = the_decline(federation, study_id, round_id)
    assert "the secure round's view breaks its setup: " + says in reason, reason
    told = [a.received for a in victim.wire.answers if a.altered]
    assert told and all(LYON in view["dropped"] for view in told)  # what the victim would have unmasked lyon with
    assert revealed_attempt(victim.worker.store, store_key(federation, study_id), 1) is None
    assert_no_owner_unmasked(federation, round_id)
    assert sorted(reveals(federation, round_id)) == OTHERS  # the others revealed the set they all signed
    first = federation.rounds(study_id)[0]
    assert first["status"] == "completed" and sorted(u["site"] for u in first["updates"]) == sorted(SITES), first


@pytest.mark.parametrize("url", [True, False], ids=["url_and_digest", "digest_only"])
def test_a_task_of_another_theta_g_is_refused_before_training(federation: Federation, url: bool) -> None:
    study_id = federation.start(**SECURE)
    other = federation.start(OTHERS, **{**SECURE, "seed": 6})  # the same model, another theta^g_0
    digest = hashlib.sha256(federation.model(other, 0)).hexdigest()
    own = federation.rounds(study_id)[0]["base_sha256"]
    assert digest != own

    def another_theta(task: dict[str, Any]) -> None:
        task["global_model_sha256"] = digest  # what the victim would sign in its advertisement
        if url:
            task["global_model_url"] = f"/api/v1/studies/{other}/models/0"

    victim = federation.victim
    victim.wire.on_task = once(another_theta)
    round_id = federation.rounds(study_id)[0]["id"]
    if url:  # the URL is not the one the site derives: declined before any download
        assert victim.worker.poll_once()
        says = f"global_model_url is '/api/v1/studies/{other}/models/0', not '/api/v1/studies/{study_id}/models/0'"
        assert_declined(federation, study_id, round_id, says)
        return
    with pytest.raises(IntegrityError, match=f"sha256 {own} differs from the announced {digest}"):
        victim.worker.poll_once()  # its own theta^g_0, whose bytes are not the digest the task names: not trained
    assert [s.path for s in victim.wire.sent if s.method == "POST"] == []  # no advertisement (no decline either)
    assert victim.worker.secure is None and federation.declines(study_id) == []


def test_an_advertisement_of_another_theta_g_signed_by_its_site_is_refused(federation: Federation) -> None:
    study_id = federation.start(**SECURE)
    victim, lyon = federation.victim, federation.sites["lyon"]
    crafted = hashlib.sha256(b"theta^g the hub gave lyon alone").hexdigest()

    def lyon_trained_elsewhere(view: dict[str, Any]) -> None:
        task = victim.wire.tasks()[0].original
        peer = relayed(view, "lyon")
        message = advertisement(peer, crafted).message(context_of(task))
        peer["global_sha256"], peer["signature"] = crafted, lyon.worker.identity.sign(message).hex()  # lyon's own

    victim.wire.on_view = once(lyon_trained_elsewhere, phase=1)
    federation.poll(federation.everyone)  # each trains and advertises
    assert victim.worker.poll_once()  # reads lyon's advertisement of another model: declines
    task = victim.wire.tasks()[0].original
    round_id = task["round_id"]
    assert posted(victim) == ["advertisement", "decline"]  # no shares: no secret of the victim is held by anyone
    reason = the_decline(federation, study_id, round_id)
    own = task["global_model_sha256"]
    assert f"site 1 trained from theta^g {crafted[:12]}, this site from {own[:12]}: the server gave sites " in reason
    assert json.loads(victim.wire.posts("/advertisement")[0].body)["global_sha256"] == own


def revealed_then_failed(federation: Federation, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict[str, Any]]:
    """A study whose round 1 attempt 1 failed after every site revealed; (study id, attempt 1's round).

    The aggregation raises once every reveal is in; the retry policy opens attempt 2 (round_retries 1: the last).
    """
    study_id = federation.start(**{**SECURE, "round_retries": 1})

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the hub fails the round after the unmasking")

    monkeypatch.setattr(secure_workflow, "server_round_from_sums", fails)  # after the reveals, in the aggregation
    for _ in range(5):  # advertise, share, mask, sign, reveal: one phase a pass
        federation.poll(federation.everyone)
    first, second = federation.rounds(study_id)
    assert (first["attempt"], first["status"]) == (1, "failed") and "RuntimeError: the hub fails" in first["note"]
    assert (second["attempt"], second["status"]) == (2, "open"), second
    assert sorted(reveals(federation, first["id"])) == sorted(SITES)  # every site revealed in attempt 1
    return study_id, first


def test_no_site_takes_another_attempt_of_a_round_it_revealed(
    federation: Federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, _ = revealed_then_failed(federation, monkeypatch)
    federation.drive(study_id, federation.everyone, until_round=1)  # each reads attempt 1's end, then attempt 2's task
    second = federation.rounds(study_id)[1]
    assert (second["attempt"], second["status"]) == (2, "failed"), second
    assert "phase advertise: 0 of 0 sites" in second["note"], second  # every site declined it
    assert federation.get(f"/api/v1/studies/{study_id}")["status"] == "failed"  # retries spent
    declines = {e["actor"]: e["detail"]["reason"] for e in federation.declines(study_id)}
    assert len(declines) == len(SITES) and all(e["round_id"] == second["id"] for e in federation.declines(study_id))
    for site in federation.everyone:
        assert posted(site, second["id"]) == ["decline"], site.name  # no advertisement: nothing trained or sent
        (reason,) = [reason for actor, reason in declines.items() if site.name in actor]
        assert "this site revealed its shares in attempt 1 of round 1: it takes no further task of the round" in reason
        store = site.worker.store
        assert revealed_attempt(store, store_key(federation, study_id), 1) == 1
        assert len(site.wire.gets(f"/api/v1/studies/{study_id}/models/0")) == 1  # attempt 1's download only
        record = (store.root / f"protected-{LEDGER}.enc").read_bytes()  # the ledger, counted outside the store too
        assert b"revealed" not in record and b'"1": 1' not in record and b"used" not in record  # encrypted


def as_attempt_1(task: dict[str, Any]) -> dict[str, Any] | None:
    """Attempt 2's task relabelled attempt 1, its secure block the one attempt 1 had (public: the hub computes it)."""
    if task["attempt"] != 2:
        return None
    terms = StudyTerms.model_validate(task["terms"])
    facts = {key: task[key] for key in ("study_uid", "participants", "site", "round_id")}
    info = secure_round_info(terms, number=task["round"], attempt=1, **facts)
    task["attempt"], task["secure"] = 1, info.model_dump(mode="json")
    return task


def test_a_retry_relabelled_as_the_revealed_attempt_is_declined(
    federation: Federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    study_id, first = revealed_then_failed(federation, monkeypatch)
    second = federation.rounds(study_id)[1]
    victim = federation.victim
    victim.wire.on_task = as_attempt_1
    assert victim.worker.poll_once()  # reads attempt 1's end
    victim.worker.poll_once()  # attempt 2's task, relabelled attempt 1 (round_id, URLs: attempt 2's)
    (answer,) = [a for a in victim.wire.tasks() if a.altered]
    assert (answer.received["round_id"], answer.received["attempt"]) == (second["id"], 1)
    assert posted(victim, second["id"]) == ["decline"]  # it revealed round 1's shares: it advertises nothing more
    reason = the_decline(federation, study_id, second["id"])
    assert "this site revealed its shares in attempt 1 of round 1" in reason, reason


def test_advertisements_replayed_from_another_attempt_are_refused(federation: Federation) -> None:
    study_id = federation.start(**SECURE)
    victim = federation.victim
    federation.poll(federation.everyone)  # each trains and advertises
    assert victim.worker.poll_once()  # the victim reads phase 1 (the others' advertisements) and shares
    (earlier,) = [a.original for a in victim.wire.answers if a.original and a.original.get("phase") == 1]
    federation.tick(after_s=60)  # phase 1's deadline with 1 share of 4: attempt 1 fails, the retry opens attempt 2
    first, second = federation.rounds(study_id)
    assert first["status"] == "failed" and "phase share: 1 of 4 sites, 3 needed" in first["note"], first
    replayed = [peer for peer in earlier["peers"] if peer["site"] != OSLO]

    def replay(view: dict[str, Any]) -> dict[str, Any] | None:
        if view["round_id"] != second["id"] or view["phase"] != 1:
            return None
        view["peers"] = [*replayed, relayed(view, VICTIM)]
        return view

    victim.wire.on_view = replay
    federation.drive(study_id, federation.everyone, until_round=1)  # attempt 2: the others complete it alone
    assert posted(victim, second["id"]) == ["advertisement", "decline"]  # no shares in attempt 2
    reason = the_decline(federation, study_id, second["id"])
    assert "advertisement is not signed by its signing key" in reason, reason
    (answer,) = [a for a in victim.wire.answers if a.altered]
    told, fresh = (
        {p["cipher_public"] for p in view["peers"] if p["site"] != OSLO} for view in (answer.received, answer.original)
    )
    assert told == {p["cipher_public"] for p in replayed} and len(told) == 3 and not told & fresh  # old keys only
    (task,) = [t.original for t in victim.wire.tasks() if t.original and t.original["round_id"] == second["id"]]
    assert task["attempt"] == 2
    for peer in replayed:  # each a genuine signature by its site's key, of attempt 1: none holds in attempt 2
        (owner,) = [site for site, number in NUMBER.items() if number == peer["site"]]
        key = bytes.fromhex(federation.sites[owner].worker.identity.public_hex())
        signature = bytes.fromhex(peer["signature"])
        assert verify(key, advertisement(peer).message(context_of(task, attempt=1)), signature)
        assert not verify(key, advertisement(peer).message(context_of(task)), signature)
    final = federation.rounds(study_id)[1]
    assert final["status"] == "completed" and sorted(u["site"] for u in final["updates"]) == OTHERS, final
