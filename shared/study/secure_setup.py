"""A secure study's rounds as its terms make them: c, each round's parameters and quorum, and its public setup.

The coordinator, the site agent and the in-process runner derive every round's setup here, from
the terms alone (shared/study/round_terms.py adds the round's public facts):

- `colluding_sites`: c, the terms' or (K - 1) // 3 of the study's K sites;
- `round_parameters`: k neighbours, threshold t, signature quorum q and the fewest survivors of a
  round of K sites (shared/privacy/graph.py: split-proof against a lying server with c colluders);
- `round_quorum`: the fewest sites whose sum a round releases (the phase engine's quorum, which
  distributed DP sizes its noise shares for);
- `check_secure_study`: why terms cannot run securely in the rounds their participation policy picks;
- `round_setup`: the public RoundSetup of one round (sites numbered 1..K in sorted name order).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from shared.errors import PrivacyInputError
from shared.privacy.errors import SetupError
from shared.privacy.graph import SecureParameters, adversary_parameters
from shared.privacy.messages import RoundSetup
from shared.privacy.quantize import FixedPoint
from shared.privacy.signing import RoundContext

__all__ = [
    "check_secure_study",
    "colluding_sites",
    "graph_seed",
    "round_parameters",
    "round_quorum",
    "round_setup",
    "round_sizes",
    "secure_summary",
    "site_numbers",
    "study_round_quorum",
]

_SECURE = "privacy.secure_aggregation"


class SecureAggregation(Protocol):
    """A study's secure-aggregation settings (shared.terms.SecureAggregation), as this module reads them."""

    @property
    def neighbour_count(self) -> int | None: ...
    @property
    def threshold(self) -> int | None: ...
    @property
    def fraction_bits(self) -> int: ...
    @property
    def ring_bits(self) -> int: ...
    @property
    def colluding(self) -> int | None: ...

    def colluding_among(self, site_count: int) -> int: ...


class StudyTerms(Protocol):
    """A study's terms (shared.terms.StudyTerms), as this module reads them: the few fields it needs."""

    @property
    def min_sites(self) -> int: ...
    @property
    def sites(self) -> list[str]: ...
    @property
    def participation(self) -> Any: ...
    @property
    def privacy(self) -> Any: ...


def colluding_sites(config: StudyTerms) -> int:
    """c, the most sites that may collude with the coordinator: the terms', else a third of the others (K - 1) // 3."""
    secure = config.privacy.secure_aggregation
    assert secure is not None
    colluding: int = secure.colluding_among(len(config.sites))
    return colluding


def round_parameters(secure: SecureAggregation, site_count: int, colluding: int) -> SecureParameters:
    """k, t, q and the fewest survivors of a round of `site_count` sites against `colluding` colluders.

    graph.adversary_parameters chooses them (complete graph up to 100 sites, a sparse graph meeting
    a 2^-40 bound above; 2t > k + m, q = floor((K + c) / 2) + 1 signatures, at least max(t + 1, q,
    c + 2) survivors); a SetupError names what cannot hold.
    """
    return adversary_parameters(
        site_count, colluding, neighbour_count=secure.neighbour_count, threshold=secure.threshold
    )


def round_quorum(min_sites: int, min_survivors: int | None) -> int:
    """The fewest sites a round releases a sum of: the study's min_sites, and a secure round's fewest survivors."""
    return max(min_sites, min_survivors or 0)


def study_round_quorum(config: StudyTerms, site_count: int) -> int:
    """`round_quorum` of a round of `site_count` participants of `config` (its fewest survivors when secure)."""
    secure = config.privacy.secure_aggregation
    if secure is None:
        return config.min_sites
    return round_quorum(config.min_sites, round_parameters(secure, site_count, colluding_sites(config)).min_survivors)


def round_sizes(config: StudyTerms) -> Sequence[int]:
    """Every number of sites a round of the study may have: K under `all`, else min_sites..K."""
    from shared.algorithms.participation import PARTICIPATIONS

    if PARTICIPATIONS[config.participation.name].picks_every_site:
        return [len(config.sites)]  # the final evaluation, too, asks every site
    return range(config.min_sites, len(config.sites) + 1)


def check_secure_study(config: StudyTerms) -> None:
    """SetupError saying why `config` cannot run under secure aggregation in every round size it may pick."""
    secure = config.privacy.secure_aggregation
    assert secure is not None
    if config.min_sites < 2:
        raise SetupError(
            "min_sites", "secure aggregation needs min_sites >= 2: the sum of a single site's update is that update"
        )
    if secure.ring_bits == 32:
        _check_narrow_range(config, secure.fraction_bits)
    colluding = colluding_sites(config)
    if colluding > len(config.sites) - 2:
        raise SetupError(
            f"{_SECURE}.colluding",
            f"{colluding} colluding sites of {len(config.sites)} leave fewer than two honest ones, whose sum "
            "alone would be private",
        )
    for site_count in round_sizes(config):
        round_parameters(secure, site_count, colluding)


def _check_narrow_range(config: StudyTerms, fraction_bits: int) -> None:
    """SetupError unless `fraction_bits` fits a 32-bit ring (a DP study's sum is checked by dp.py)."""
    try:
        FixedPoint(fraction_bits, ring_bits=32)
    except PrivacyInputError as exc:
        raise SetupError(f"{_SECURE}.fraction_bits", f"{exc} (at most 28 bits, or ring_bits 64)") from None


def site_numbers(sites: Sequence[str]) -> dict[str, int]:
    """Each participant's number 1..K (its Shamir point), in sorted name order."""
    return {site: number for number, site in enumerate(sorted(sites), start=1)}


def graph_seed(study_uid: str, round_key: int) -> bytes:
    """The public seed of a round's neighbour graph: fixed by the study and the round, chosen by no one."""
    return hashlib.sha256(f"cardiofl-secagg-graph:{study_uid}:{round_key}".encode()).digest()


def round_setup(
    secure: SecureAggregation,
    *,
    study_uid: str,
    round_key: int,
    sites: Sequence[str],
    colluding: int,
    signing_keys: Mapping[str, str] | None = None,
    context: RoundContext | None = None,
) -> RoundSetup:
    """The public setup of one round: `round_key` binds keys and shares; signed with the sites' keys (hex, by name)."""
    parameters = round_parameters(secure, len(sites), colluding)
    numbers = site_numbers(sites)
    keys = {numbers[site]: bytes.fromhex(key) for site, key in (signing_keys or {}).items() if site in numbers}
    return RoundSetup(
        study_uid=study_uid,
        round_no=round_key,
        sites=tuple(numbers.values()),
        graph_seed=graph_seed(study_uid, round_key),
        neighbour_count=parameters.neighbour_count,
        threshold=parameters.threshold,
        min_survivors=parameters.min_survivors,
        signature_quorum=parameters.signature_quorum,
        signing_keys=keys,
        context=context if keys else None,
    )


def secure_summary(config: StudyTerms) -> list[str]:
    """What a secure study's rounds tolerate and what its coordinator can still learn, in lines for people."""
    secure = config.privacy.secure_aggregation
    if secure is None:
        return []
    colluding = colluding_sites(config)
    lines = []
    for site_count in sorted({min(round_sizes(config)), len(config.sites)}):
        p = round_parameters(secure, site_count, colluding)
        graph = (
            "every other site"
            if p.complete
            else f"{p.neighbour_count} neighbours ({p.neighbourhood_dropouts} may drop)"
        )
        lines.append(
            f"against {colluding} colluding site(s), a round of {site_count} sites: shares with {graph}, threshold "
            f"{p.threshold}, {p.signature_quorum} consistency signatures, at least {p.min_survivors} survivors "
            f"({p.dropouts} may drop)"
        )
    dp = config.privacy.dp
    bound = (
        "distributed DP bounds it (each round's sum is noised; epsilon counts every round)"
        if dp is not None and dp.mode == "distributed"
        else "nothing bounds it without distributed DP"
    )
    lines.append(
        "across rounds: a site takes part in no two secure rounds from the same theta^g tensors, so a model served "
        "again is refused; a coordinator that alters theta^g between two rounds could difference their sums into an "
        f"approximation of one site's update, blurred by the other sites' fresh training randomness: {bound}"
    )
    if dp is not None and dp.mode == "central":
        lines.append("central DP: the coordinator unmasks the sum before it adds the noise, so it sees it un-noised")
    return lines
