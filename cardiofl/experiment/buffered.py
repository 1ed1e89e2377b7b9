"""A buffered asynchronous study in process: which update fills which buffer on a simulated clock, then the releases.

The service's rule (shared/terms/buffered.py): every site trains from the latest version it was given,
its update joins the buffer open when it arrives, a site has at most one update in a buffer and is
given the next version once that buffer is released, and an update more than `max_staleness` versions
behind is refused (the site then trains again from the latest version, its phi_k as before).

`buffer_schedule` plays that rule on a simulated clock where site k's round takes `seconds[k]` (ties
go by site name): it fixes each buffer's members and the round each was tasked in, before anything
trains. `simulate_buffered` then trains and releases buffer by buffer, each member from theta^g of the
version it was given, with its phi_k as its last accepted update left it and its random streams
seeded by the round it was tasked in, as the agent seeds them; members are read in name order and
released by the service's own step (shared/study/server_round.py buffered_server_round). A schedule
read from a service's audit trail (each release's members and their bases) replays that study bit
for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from cardiofl.experiment.server import aggregate_buffer
from cardiofl.experiment.site_rounds import BufferFacts, RoundOutcome, external_summaries, site_round
from shared.study.accounting import trained_rounds
from shared.study.dp import seeded_noise
from shared.tensors.codec import TensorDict
from shared.terms import BufferedSpec, StudyTerms
from site_agent.data import SiteData
from site_agent.device import Runtime
from site_agent.local_round import LocalRoundResult

__all__ = ["Buffer", "buffer_schedule", "simulate_buffered"]


@dataclass(frozen=True)
class Buffer:
    """One release's buffer: each member with the round it was tasked in (it trained from theta^g_{round - 1})."""

    members: dict[str, int]
    clock: float | None = None  # simulated seconds when it filled (None: replayed from a service)
    refused: tuple[str, ...] = ()  # sites whose update came too stale while it was open


def buffer_schedule(
    sites: Sequence[str], seconds: Mapping[str, float], spec: BufferedSpec, releases: int
) -> list[Buffer]:
    """The buffers of `releases` versions when every site starts at 0 and site k's round takes `seconds[k]`."""
    if not sites:
        return []
    size = min(spec.buffer_size, len(sites))
    finish = {site: float(seconds.get(site, 1.0)) for site in sites}  # the sites training now: when they arrive
    tasked = dict.fromkeys(sites, 1)  # the round each was tasked in
    buffers: list[Buffer] = []
    members: dict[str, int] = {}
    refused: list[str] = []
    while len(buffers) < releases:
        site = min(finish, key=lambda name: (finish[name], name))
        clock = finish.pop(site)
        open_round = len(buffers) + 1
        if open_round - tasked[site] > spec.max_staleness:  # refused: trains again from the latest version
            refused.append(site)
            tasked[site] = open_round
            finish[site] = clock + seconds.get(site, 1.0)
            continue
        members[site] = tasked[site]
        if len(members) == size:
            buffers.append(Buffer(dict(sorted(members.items())), clock, tuple(refused)))
            for member in members:  # given the version just released
                tasked[member] = open_round + 1
                finish[member] = clock + seconds.get(member, 1.0)
            members, refused = {}, []
    return buffers


def simulate_buffered(
    study: StudyTerms,
    data: Mapping[str, SiteData],
    runtime: Runtime,
    start: tuple[TensorDict, TensorDict],
    private: MutableMapping[str, TensorDict],
    *,
    seconds: Mapping[str, float] | None = None,
    schedule: Sequence[Buffer] | None = None,
) -> Iterator[RoundOutcome]:
    """Each release of a buffered `study` from (theta^g_0, phi_0) = `start`; `private` gets each site's phi_k.

    `schedule` replays given buffers; by default they come from `buffer_schedule` on `seconds` (1 each).
    """
    spec = study.buffered
    assert spec is not None
    releases = trained_rounds(study)
    if schedule is None:
        schedule = buffer_schedule(study.sites, seconds or {}, spec, releases)
    theta, phi_0 = start
    versions: dict[int, TensorDict] = {0: theta}  # the versions an update may still have trained from
    for version, buffer in enumerate(schedule[:releases], start=1):
        results: dict[str, LocalRoundResult] = {}
        bases: dict[str, int] = {}
        for site in sorted(buffer.members):
            tasked = buffer.members[site]
            bases[site] = tasked - 1
            results[site] = site_round(
                study, site, tasked, study.sites, versions[tasked - 1], private.get(site, phi_0), phi_0,
                data[site], runtime,
            )  # fmt: skip
            private[site] = results[site].local
        contributions = [(site, results[site], bases[site]) for site in sorted(results)]
        with seeded_noise(f"{study.seed}|{version}|server"):  # central DP: the release's noise, from the seed
            theta, weights = aggregate_buffer(study, versions, version - 1, contributions)
        versions[version] = theta
        for old in [v for v in versions if v < version - spec.max_staleness]:
            del versions[old]
        external = external_summaries(study, version, theta, phi_0, data, runtime, final=version == releases)
        facts = BufferFacts(bases, buffer.refused)
        yield RoundOutcome(
            version, "train", theta, results, weights, external=external, buffer=facts, clock=buffer.clock
        )
