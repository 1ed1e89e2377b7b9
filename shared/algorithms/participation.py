"""Centre dropout (DataTools4Heart, papers/003): which sites take part in a round.

A policy returns the chosen sites; shared/study/rules.py `select_participants` then checks `min_sites`
and gives each chosen site the load factor |all| / |chosen|, which scales its local steps so the
round's total training effort is kept. Every policy here keeps at least `min_sites` sites itself.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from shared.algorithms.params import FractionParams, NoParams, RandomDropoutParams

__all__ = [
    "PARTICIPATIONS",
    "Participation",
    "ParticipationRound",
    "every_site",
    "fast_on_odd",
    "fast_on_odd_sizes",
    "fewer_on_odd",
    "random_dropout",
]


@dataclass(frozen=True)
class ParticipationRound:
    """What a participation policy may look at when it picks the sites of one round."""

    sites: tuple[str, ...]  # every enrolled site of the study, in config order
    round_number: int
    min_sites: int
    rng: random.Random  # seeded from (study seed, round, attempt): the same pick after a restart
    # site -> its last measured round time in seconds per unit of load factor; only sites measured so far
    round_seconds: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Participation:
    """A participation policy: its parameters, the pick of sites for a round, and what it reads."""

    params: type[BaseModel]
    select: Callable[[ParticipationRound, BaseModel], Sequence[str]]
    uses_round_times: bool = False  # the caller fills ParticipationRound.round_seconds only when True
    # A policy that reads round times (which a site cannot see) says how many sites its pick may hold,
    # (fewest, most), so that a site can check the pick a task names; other picks are recomputed whole.
    sizes: Callable[[ParticipationRound, BaseModel], tuple[int, int]] | None = None
    picks_every_site: bool = False  # every round is of all the study's sites (secure settings are checked at K only)


def every_site(round_: ParticipationRound, _params: BaseModel) -> Sequence[str]:
    """`all`: every site, every round."""
    return round_.sites


def random_dropout(round_: ParticipationRound, params: BaseModel) -> Sequence[str]:
    """`random(p)`: each site is left out with probability p; dropped sites are drawn back up to min_sites."""
    assert isinstance(params, RandomDropoutParams)
    draws = [round_.rng.random() for _ in round_.sites]
    kept = [site for site, draw in zip(round_.sites, draws, strict=True) if draw >= params.p]
    dropped = [site for site in round_.sites if site not in kept]
    missing = max(round_.min_sites - len(kept), 0)
    return _in_config_order(round_, set(kept) | set(round_.rng.sample(dropped, missing)))


def _drop_count(round_: ParticipationRound, fraction: float) -> int:
    """floor(f * K) sites, but never so many that fewer than min_sites remain."""
    k = len(round_.sites)
    return min(math.floor(fraction * k + 1e-9), k - round_.min_sites)


def fewer_on_odd(round_: ParticipationRound, params: BaseModel) -> Sequence[str]:
    """`fewer_on_odd(f)`: on odd rounds a random floor(f * K) of the sites sit out; even rounds take all."""
    assert isinstance(params, FractionParams)
    if round_.round_number % 2 == 0:
        return round_.sites
    dropped = set(round_.rng.sample(round_.sites, _drop_count(round_, params.f)))
    return [site for site in round_.sites if site not in dropped]


def fast_on_odd(round_: ParticipationRound, params: BaseModel) -> Sequence[str]:
    """`fast_on_odd(f)`: on odd rounds the slowest floor(f * K) sites sit out; even rounds take all.

    Slowest by each site's last measured round time per unit of load factor. A site never
    measured yet is not known to be slow and always takes part (so round 1 takes every site);
    equal times are ordered at random.
    """
    assert isinstance(params, FractionParams)
    if round_.round_number % 2 == 0:
        return round_.sites
    measured = [site for site in round_.sites if site in round_.round_seconds]
    round_.rng.shuffle(measured)
    slowest_first = sorted(measured, key=lambda site: round_.round_seconds[site], reverse=True)
    dropped = set(slowest_first[: _drop_count(round_, params.f)])
    return [site for site in round_.sites if site not in dropped]


def fast_on_odd_sizes(round_: ParticipationRound, params: BaseModel) -> tuple[int, int]:
    """How many sites `fast_on_odd(f)` picks: every site on even rounds, K - floor(f * K) to K on odd ones."""
    assert isinstance(params, FractionParams)
    k = len(round_.sites)
    return (k, k) if round_.round_number % 2 == 0 else (k - _drop_count(round_, params.f), k)


def _in_config_order(round_: ParticipationRound, chosen: set[str]) -> list[str]:
    return [site for site in round_.sites if site in chosen]


# The names a study's `participation` may take.
PARTICIPATIONS: dict[str, Participation] = {
    "all": Participation(NoParams, every_site, picks_every_site=True),
    "random": Participation(RandomDropoutParams, random_dropout),
    "fewer_on_odd": Participation(FractionParams, fewer_on_odd),
    "fast_on_odd": Participation(FractionParams, fast_on_odd, uses_round_times=True, sizes=fast_on_odd_sizes),
}
