"""The split-view attack through real agents: a hub with one colluding site tells two groups two stories of oslo.

The real coordinator relays phases 0-2 honestly; from phase 3 on the hub (the proxy) tells group 2
of oslo's honest neighbours "oslo dropped" (oslo's mask key wanted) while group 1 and oslo hear the
truth, "oslo survived" (its self mask wanted), and in phase 4 shows each group only the consistency
signatures of its own story: group 2's own (which the honest coordinator refused, 422, and the proxy
kept) and the colluding site's, which signs both stories with its own key and hands over the shares
of oslo's secrets it holds (lyon). The study runs the default terms against c = (K - 1) // 3 = 1.

| K (database)         | k, t, q, fewest | groups            | outcome                                          |
| -------------------- | --------------- | ----------------- | ------------------------------------------------ |
| 4 (SQLite, Postgres) | 3, 3, 3, 4      | 1: rome; 2: turin | turin leaves before it signs (3 survivors in its |
|                      |                 |                   | story, 4 needed); rome reveals; the hub holds 2  |
|                      |                 |                   | of oslo's self-mask shares, 1 of its mask key:   |
|                      |                 |                   | neither rebuilt                                  |
| 6 (SQLite)           | 5, 4, 4, 5      | 1: bern, gent;    | rome and turin sign their story but see 3        |
|                      |                 | 2: rome, turin    | signatures of it, 4 needed: they decline and     |
|                      |                 |                   | reveal nothing; the hub holds 3 self-mask shares |
|                      |                 |                   | and 1 mask-key share: neither rebuilt            |

Under protocol 5's t = 2 (K = 4) or t = 3 (K = 6) and t consistency signatures, both groups would
have revealed and the hub rebuilt both secrets (tests/shared/privacy/test_split_view.py plays the
same attack through the project's own ClientStates, under both rules).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.main import create_app
from shared.privacy.errors import NotEnoughShares
from shared.privacy.shamir import Share, reconstruct_secret
from shared.privacy.signing import consistency_message
from shared.study.secure_setup import site_numbers
from site_agent.data import SiteData
from site_agent.errors import TaskRejected
from tests.conftest import coordinator_settings_for, create_tables
from tests.hostile.harness import TRAINING, VICTIM, Federation, Site, federation_of, posted, synthetic_hospitals
from tests.hostile.proxy import Alteration

SIX = ("bern", "gent", "lyon", "oslo", "rome", "turin")
COLLUDER = "lyon"


def study(sites: list[str]) -> dict[str, Any]:
    """The default secure terms (c = (K - 1) // 3), every site in every round."""
    privacy = {"min_records": 1, "secure_aggregation": {"phase_timeout_s": 30.0}}
    return {"rounds": 1, "min_sites": len(sites), "seed": 5, "training": TRAINING, "privacy": privacy}


@pytest.fixture(scope="module")
def six_sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteData]:
    return synthetic_hospitals(tmp_path_factory.mktemp("split-view-ecg"), SIX, seed=4)


def x_dropped(number: int, signatures: Callable[[], dict[str, str]]) -> Alteration:
    """Phases 3 and 4 for group 2: the victim (`number`) dropped; in phase 4 only that story's signatures."""

    def alter(view: dict[str, Any]) -> dict[str, Any] | None:
        if view["phase"] not in (3, 4):
            return None
        view["survivors"] = [site for site in view["survivors"] if site != number]
        view["dropped"] = sorted([*view["dropped"], number])
        if view["phase"] == 4:  # the hub took the signature of its story (the honest coordinator refused it)
            view["signatures"], view["sent"] = signatures(), sorted({*view["sent"], 3})
        return view

    return alter


def poll(sites: list[Site]) -> None:
    """One poll of each site; a consistency signature of the hub's story is refused by the coordinator (422)."""
    for site in sites:
        try:
            site.worker.poll_once()
        except TaskRejected:
            assert site.wire.posts("/consistency")[-1].status == 422


def attack(federation: Federation, names: list[str], second: list[str]) -> dict[str, Any]:
    """Run the attack on oslo over a study of `names`, `second` told it dropped; what the hub and the sites hold."""
    study_id = federation.start(names, **study(names))
    numbers = site_numbers(names)
    victim, colluder = federation.victim, federation.sites[COLLUDER]
    for _ in range(3):  # advertise, share, mask: every site, honestly relayed; phase 3 opens
        federation.poll(federation.everyone)
    round_id = federation.rounds(study_id)[0]["id"]
    held = {name: site.worker.secure.secrets._held for name, site in federation.sites.items() if site.worker.secure}
    seed = victim.worker.secure.secrets._self_mask_seed  # type: ignore[union-attr]
    secrets = colluder.worker.secure.secrets  # type: ignore[union-attr]
    setup = secrets.setup
    everyone = frozenset(numbers.values())
    lie = (everyone - {numbers[VICTIM]}, frozenset({numbers[VICTIM]}))
    assert setup.context is not None

    def story_2_signatures() -> dict[str, str]:
        message = consistency_message(setup.context, *lie, secrets._advertisers)  # type: ignore[arg-type]
        signed = {str(numbers[COLLUDER]): colluder.worker.identity.sign(message).hex()}
        for name in second:
            for sent in federation.sites[name].wire.posts("/consistency"):
                signed[str(numbers[name])] = json.loads(sent.body)["signature"]
        return signed

    for name in second:
        federation.sites[name].wire.on_view = x_dropped(numbers[VICTIM], story_2_signatures)
    poll(federation.everyone)  # sign: group 2 signs the hub's story (refused by the honest coordinator) or leaves
    federation.tick(after_s=60)  # phase 3's deadline: the true story's signatures, a quorum, open phase 4
    told = [federation.sites[name] for name in second]  # first: the others' reveals end the phase
    poll([*told, *(site for site in federation.everyone if site not in told)])  # group 2 sees too few signatures
    # of its story; oslo, group 1 and the colluder reveal
    if federation.rounds(study_id)[0]["status"] == "open":
        federation.tick(after_s=120)  # phase 4's deadline: the coordinator tries to unmask
    reveals = {
        name: json.loads(sent.body) for name, site in federation.sites.items() for sent in site.wire.posts("/reveal")
    }
    return {"study": study_id, "round": round_id, "numbers": numbers, "held": held, "seed": seed, "reveals": reveals}


def hub_haul(found: dict[str, Any]) -> dict[str, list[Share]]:
    """The shares of oslo's secrets the hub holds: every reveal it was sent, and the colluder's own."""
    x, numbers = found["numbers"][VICTIM], found["numbers"]
    shares: dict[str, list[Share]] = {"self_mask_shares": [], "mask_key_shares": []}
    for name, reveal in found["reveals"].items():
        for kind in shares:
            if str(x) in reveal[kind]:
                shares[kind].append(Share(numbers[name], int(reveal[kind][str(x)], 16)))
    own = found["held"][COLLUDER][x]
    for kind, value in (("self_mask_shares", own.self_mask_share), ("mask_key_shares", own.mask_key_share)):
        if numbers[COLLUDER] not in {share.x for share in shares[kind]}:
            shares[kind].append(Share(numbers[COLLUDER], value))
    return shares


def assert_nothing_rebuilt(federation: Federation, found: dict[str, Any], second: list[str], threshold: int) -> None:
    shares = hub_haul(found)
    for kind, got in shares.items():
        assert len(got) < threshold, (kind, got)
        with pytest.raises(NotEnoughShares):
            reconstruct_secret(got, threshold=threshold)
    for name in second:
        site = federation.sites[name]
        assert "reveal" not in posted(site, found["round"]), name  # group 2 revealed nothing
        assert all(json.loads(s.body).get("mask_key_shares") == {} for s in site.wire.posts("/reveal"))
    # the control: the shares are real; group 2's, which a believed story would have added, rebuild the self mask
    x = found["numbers"][VICTIM]
    extra = [Share(found["numbers"][name], found["held"][name][x].self_mask_share) for name in second]
    assert reconstruct_secret(shares["self_mask_shares"] + extra, threshold=threshold) == found["seed"]
    first = federation.rounds(found["study"])[0]
    assert first["status"] == "failed" and first["global_model_sha256"] is None, first  # no sum was released


def test_the_split_view_attack_at_four_sites_rebuilds_nothing(federation: Federation) -> None:
    found = attack(federation, sorted(federation.sites), second=["turin"])
    assert posted(federation.sites["turin"], found["round"]) == ["advertisement", "shares", "updates"]  # left
    assert "reveal" in posted(federation.sites["rome"], found["round"])  # group 1 believed the true story
    assert_nothing_rebuilt(federation, found, ["turin"], threshold=3)


def test_the_split_view_attack_at_six_sites_rebuilds_nothing(six_sites: dict[str, SiteData], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    create_tables(url)
    with TestClient(create_app(coordinator_settings_for(url, blob_dir=str(tmp_path / "blobs")))) as client:
        federation = federation_of(client, six_sites, tmp_path)
        found = attack(federation, list(SIX), second=["rome", "turin"])
        for name in ("rome", "turin"):
            site = federation.sites[name]
            assert [s.status for s in site.wire.posts("/consistency")] == [422]  # it signed the hub's story
            (decline,) = site.wire.posts(f"/api/v1/rounds/{found['round']}/decline")
            reason = json.loads(decline.body)["reason"]
            assert "3 survivors signed the survivor set, the quorum is 4" in reason, reason
        for name in ("bern", "gent"):
            assert "reveal" in posted(federation.sites[name], found["round"])
        assert_nothing_rebuilt(federation, found, ["rome", "turin"], threshold=4)
