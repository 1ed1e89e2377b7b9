"""Four real site agents and the real coordinator app, each agent through a HostileTransport (the victim's: oslo)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import utc_now
from coordinator.rounds.closing import tick
from site_agent.client import CoordinatorClient
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.synthetic import generate_sites
from site_agent.device import resolve_runtime
from site_agent.store import SiteStore, generate_key
from site_agent.worker import SiteWorker
from tests.coordinator.factories import ADMIN, create_study, enrol
from tests.hostile.proxy import Alteration, HostileTransport

__all__ = [
    "CPU",
    "NUMBER",
    "OTHERS",
    "SECURE",
    "SITES",
    "STATISTICS",
    "TRAINING",
    "VICTIM",
    "Federation",
    "Site",
    "assert_declined",
    "assert_not_offered_again",
    "federation_of",
    "once",
    "posted",
    "reason_of",
    "relayed",
    "set_path",
    "synthetic_hospitals",
    "the_decline",
]

SITES = ("lyon", "oslo", "rome", "turin")
VICTIM = "oslo"
OTHERS = [site for site in SITES if site != VICTIM]
NUMBER = {site: number for number, site in enumerate(sorted(SITES), start=1)}  # in a secure round of all four
TRAINING = {"lr": 0.05, "batch_size": 8, "max_steps": 2}
# A secure study (SecAgg+) against a hub colluding with no site (c = 0: k = 3, t = 2, 3 consistency signatures,
# 3 survivors), so a round of four can lose one site (against the default c = 1 it needs all four: t = 3); min_sites
# 3; min_records 1 so the sites' counts and histograms exist and must travel under the masks only. The hub with
# colluding sites is tests/hostile/test_split_view.py's.
SECURE = {
    "rounds": 1,
    "min_sites": 3,
    "seed": 5,
    "training": TRAINING,
    "privacy": {"min_records": 1, "secure_aggregation": {"phase_timeout_s": 30.0, "colluding": 0}},
}
CPU = resolve_runtime("cpu")
STATISTICS = (b"pos_hist", b"neg_hist", b'"tp"', b'"fp"', b'"fn"')  # counts and histograms: never in the clear


@dataclass
class Site:
    """A site agent and its wire to the coordinator (altered only for the victim)."""

    name: str
    worker: SiteWorker
    wire: HostileTransport


@dataclass
class Federation:
    """The coordinator and the four sites' agents."""

    coordinator: TestClient
    sites: dict[str, Site]

    @property
    def victim(self) -> Site:
        return self.sites[VICTIM]

    @property
    def others(self) -> list[Site]:
        return [site for name, site in self.sites.items() if name != VICTIM]

    @property
    def everyone(self) -> list[Site]:
        return list(self.sites.values())

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The app's own sessions, for what a test does the coordinator's way (`tick`)."""
        return self.coordinator.app.state.coordinator.sessions

    def start(self, sites: tuple[str, ...] | list[str] = SITES, **config: Any) -> int:
        """Create and start a tiny-model study over `sites`; its id.

        The victim's operator then approves the study as offered (the offers are never altered): its
        approval record keeps those terms, and the agent approves nothing else. The other agents run
        with auto_approve.
        """
        for site in self.sites.values():  # each agent registers its signing key at its first start
            site.worker.register_identity()
        study_id = create_study(self.coordinator, list(sites), **config)
        response = self.coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN)
        assert response.status_code == 200, response.text
        victim = self.victim.worker
        for offer in victim.client.offers():
            if offer.study_id == study_id:
                victim.approvals.approve(offer, by="the victim's operator")
        return study_id

    def get(self, path: str) -> Any:
        response = self.coordinator.get(path, headers=ADMIN)
        assert response.status_code == 200, response.text
        return response.json()

    def rounds(self, study_id: int) -> list[dict[str, Any]]:
        return self.get(f"/api/v1/studies/{study_id}/rounds")["data"]

    def declines(self, study_id: int) -> list[dict[str, Any]]:
        """The study's `task.declined` audit events."""
        events = self.get(f"/api/v1/studies/{study_id}/audit")["data"]
        return [event for event in events if event["action"] == "task.declined"]

    def has_model(self, study_id: int, number: int) -> bool:
        return self.coordinator.get(f"/api/v1/studies/{study_id}/models/{number}", headers=ADMIN).status_code == 200

    def model(self, study_id: int, number: int) -> bytes:
        """theta^g_number of the study, as stored."""
        response = self.coordinator.get(f"/api/v1/studies/{study_id}/models/{number}", headers=ADMIN)
        assert response.status_code == 200, response.text
        return response.content

    def poll(self, sites: list[Site]) -> None:
        """One poll of each of `sites`, in turn."""
        for site in sites:
            site.worker.poll_once()

    def tick(self, after_s: float) -> None:
        """The coordinator's deadline check, run as if `after_s` seconds had passed (the test app runs no ticker)."""
        tick(self.sessions, now=utc_now() + timedelta(seconds=after_s), lease_s=60.0)

    def drive(self, study_id: int, sites: list[Site], *, until_round: int, polls: int = 12) -> None:
        """Poll `sites` in turn until round `until_round` of the study (its latest attempt) has left `open`."""
        for _ in range(polls):
            self.poll(sites)
            status = {r["number"]: r["status"] for r in self.rounds(study_id)}
            if status.get(until_round, "open") != "open":
                return
        raise AssertionError(f"round {until_round} is still open after {polls} polls: {self.rounds(study_id)}")


def synthetic_hospitals(root: Path, names: tuple[str, ...], seed: int) -> dict[str, SiteData]:
    """Small synthetic hospitals (about 25 training and 8 test records each) under `root`, by name."""
    folders = generate_sites(root / "raw", n_sites=len(names), records_per_site=32, seed=seed)
    return {
        name: open_site_data(ChallengeSource(path=folder, name=name), root / "cache" / name)
        for name, folder in zip(names, folders, strict=True)
    }


def federation_of(coordinator: TestClient, data: dict[str, SiteData], tmp_path: Path) -> Federation:
    """Enrol the sites of `data` (the four SITES, or more) and build their agents, each on a HostileTransport."""
    sites = {}
    for name in sorted(data):
        headers = enrol(coordinator, name)
        wire = HostileTransport(coordinator._transport)
        http = httpx.Client(transport=wire, base_url=str(coordinator.base_url), headers=headers)
        worker = SiteWorker(
            site=name,
            client=CoordinatorClient(http, poll_wait_s=0.0),
            store=SiteStore(tmp_path / "stores" / name, generate_key(), name),
            data=lambda d=data[name]: d,
            runtime=CPU,
            progress_bar=False,
            auto_approve=name != VICTIM,
        )
        sites[name] = Site(name, worker, wire)
    return Federation(coordinator, sites)


def posted(site: Site, round_id: int | None = None) -> list[str]:
    """What the site POSTed (to round `round_id`), by the URL's last segment: advertisement, shares, updates, ..."""
    prefix = f"/api/v1/rounds/{round_id}/" if round_id is not None else "/"
    return [s.path.rsplit("/", 1)[-1] for s in site.wire.sent if s.method == "POST" and s.path.startswith(prefix)]


def reason_of(body: bytes) -> str:
    """The reason of a decline's body."""
    return str(json.loads(body)["reason"])


def once(alteration: Callable[[dict[str, Any]], None], *, phase: int | None = None) -> Alteration:
    """`alteration` applied to the first answer only (with `phase`: the first secure round view of that phase)."""
    done = False

    def apply(answer: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal done
        if done or (phase is not None and answer.get("phase") != phase):
            return None
        done = True
        alteration(answer)
        return answer

    return apply


def relayed(view: dict[str, Any], site: str) -> dict[str, Any]:
    """`site`'s advertisement as a phase-1 view relays it."""
    (peer,) = [peer for peer in view["peers"] if peer["site"] == NUMBER[site]]
    return peer


def set_path(task: dict[str, Any], path: str, value: Any) -> None:
    """Set the JSON value at a dotted path ('terms.training.lr')."""
    *parents, last = path.split(".")
    node = task
    for key in parents:
        node = node[key]
    node[last] = value


def assert_declined(federation: Federation, study_id: int, round_id: int, says: str) -> str:
    """The victim declined its task of `round_id` naming `says`, sent nothing else, downloaded nothing; the reason.

    (1) one POST to the round attempt's decline URL, whose reason names what differs; (2) no other
    POST: no update, no secure round message; (3) no download of any model (theta^g, phi_0): the check
    comes first; (4) the coordinator's audit holds the decline with the same reason. Nothing the
    victim sent carries counts or histograms.
    """
    wire = federation.victim.wire
    posts = [sent for sent in wire.sent if sent.method != "GET"]
    assert [(s.method, s.path) for s in posts if s.method != "PUT"] == [
        ("POST", f"/api/v1/rounds/{round_id}/decline")
    ], posts
    puts = {s.path for s in posts if s.method == "PUT"}  # its approval and its signing key only
    assert all(path.endswith("/approval") or path == "/api/v1/sites/me/signing-key" for path in puts), puts
    reason = the_decline(federation, study_id, round_id)
    assert says in reason, reason
    downloads = [s.path for s in wire.sent if "/models/" in s.path]
    assert downloads == [], downloads
    for sent in wire.sent:
        assert not any(word in sent.body for word in STATISTICS), sent
    return reason


def the_decline(federation: Federation, study_id: int, round_id: int) -> str:
    """The victim's one decline of `round_id`: POSTed to the round attempt's URL, taken, audited as sent; its reason."""
    (decline,) = federation.victim.wire.posts(f"/api/v1/rounds/{round_id}/decline")
    assert decline.status == 204
    reason = reason_of(decline.body)
    events = federation.declines(study_id)
    assert [(e["round_id"], e["detail"]["reason"]) for e in events] == [(round_id, reason)], events
    assert VICTIM in events[0]["actor"]
    return reason


def assert_not_offered_again(federation: Federation, round_id: int) -> None:
    """(5) The victim's next poll gets no task of the round attempt it declined (nothing at all while it is open)."""
    victim = federation.victim
    polls = len(victim.wire.tasks())
    assert not victim.worker.poll_once()
    (answer,) = victim.wire.tasks()[polls:]
    assert answer.status == 204, answer
    assert len(victim.wire.posts("/decline")) == 1  # so it had nothing to decline again
